"""What oneDNN runs in one real-width CPU decode, read from its own log (`ONEDNN_VERBOSE=1`), with the conv weights
prepacked (`ops.prepack`, what `weights.load` does on a CPU computing in bf16) and without (every weight reordered on
every call, as before the prepacking). docs/benchmarks.md, "After, bf16 compute on a CPU with AMX-BF16".

    python bench/onednn_calls.py [--threads 2]

Each mode runs in its own process: the real Wan2.2 decoder with seeded weights on latents [1, 48, 3, 4, 6] (the
`cpu-real-width` workload of bench/bench.py), a warm-up decode, then one logged decode. Per primitive kind
(convolution, reorder, ...): the calls, their summed exec time (ms, oneDNN's own) and the implementations named; and
whether the two modes' videos are the same bit for bit. Writes bench/results/onednn-calls-<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = "onednn-calls: logged decode"

_CHILD = """
import sys, torch
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import random_weights
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG
from fastvideo_pan2_ext.vae_kernel.portable import ops
torch.set_num_threads(int(sys.argv[1]))
if sys.argv[2] == "unpacked":
    ops.prepack = lambda w: None  # the convs then reorder their weight on every call
decoder = WanVAEDecoder(random_weights(WAN22_CONFIG, seed=0), device="cpu", backend="torch")
z = torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(1))
decoder.decode(z)
print(%r, ops.compute_dtype(torch.device("cpu")), flush=True)
torch.save(decoder.decode(z), sys.argv[3])
""" % MARK


def summarize(log: str) -> dict:
    """Per primitive kind of the logged decode: calls, exec ms (summed), implementations (with their call counts)."""
    kinds: dict = {}
    for line in log.split(MARK, 1)[1].splitlines():
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or len(fields) < 8 or fields[2:4] != ["primitive", "exec"]:
            continue
        kind = kinds.setdefault(fields[5], {"calls": 0, "exec_ms": 0.0, "implementations": collections.Counter()})
        kind["calls"] += 1
        kind["exec_ms"] += float(fields[-1])
        kind["implementations"][fields[6]] += 1
    return {k: {**v, "implementations": dict(v["implementations"])} for k, v in kinds.items()}


def run(mode: str, threads: int, video: Path) -> dict:
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(threads), mode, str(video)], env=env, cwd=REPO,
                           capture_output=True, text=True, check=True)
    compute = child.stdout.split(MARK, 1)[1].split()[0]
    return {"compute_dtype": compute, "primitives": summarize(child.stdout)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch  # noqa: PLC0415

    from bench.machine import cpu_name  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch:
        modes = {mode: run(mode, args.threads, Path(scratch) / f"{mode}.pt") for mode in ("unpacked", "prepacked")}
        videos = [torch.load(Path(scratch) / f"{mode}.pt") for mode in modes]
    date = datetime.date.today().isoformat()
    report = {"date": date, "device_name": cpu_name(), "threads": args.threads, "torch": torch.__version__,
              "command": "python bench/onednn_calls.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "latents": [1, 48, 3, 4, 6], "modes": modes, "same_video": bool(torch.equal(*videos))}
    out = Path(args.out or REPO / "bench" / "results" / f"onednn-calls-{date}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    for mode, result in modes.items():
        for kind, k in result["primitives"].items():
            print(f"{mode:9s} {kind:12s} {k['calls']:4d} calls {k['exec_ms']:9.1f} ms  {k['implementations']}")
    print(f"same video: {report['same_video']}; wrote {out}")


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
