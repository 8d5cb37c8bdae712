"""The cost of the decoder's weight check: what `WanVAEDecoder.sync_weights` takes when the VAE is unchanged (every
decode runs it first: docs/design/worker.md, "What a weight change costs"), median of --repeats, beside the time to
prepare the weights from scratch (`release_weights` then `sync_weights`: what a decode pays after the VAE came back to
the device).

    python bench/weight_check.py [--decoder-base-dim 256] [--dtype bf16] [--cpu-compute fp32|bf16] [--out FILE]

The VAE is a module holding only the decoder's weights (seeded random, the Wan2.2 layout at the given decoder width,
drawn tensor by tensor), so the real width (256) fits a small machine: in bf16 1.1 GB, and the decoder's prepared
copy beside it (on a CPU computing in fp32, 2.2 GB). `--cpu-compute` runs the portable path as the other kind of CPU
would (fp32: no AMX-BF16; bf16: AMX-BF16, whose conv weights are also prepacked).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/weight_check.py`: the repository's package importable as in `-m` use
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench import cpu_computing_in  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.compiled.selfcheck import seeded_parameter  # noqa: E402
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def module_of(state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose `state_dict()` is `state_dict` (its tensors as parameters, nested by their dotted names)."""
    root = torch.nn.Module()
    for name, tensor in state_dict.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def decoder_module(decoder_base_dim: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    config = dataclasses.replace(WAN22_CONFIG, decoder_base_dim=decoder_base_dim)
    generator = torch.Generator().manual_seed(seed)
    return module_of({name: seeded_parameter(name, shape, generator).to(dtype)
                      for name, shape in expected_shapes(config).items()})


def timed(fn, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoder-base-dim", type=int, default=256, help="256: the real Wan2.2 decoder")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the VAE's weights' dtype")
    p.add_argument("--cpu-compute", choices=sorted(DTYPES), default=None,
                   help="run as a CPU computing in this dtype (default: as this CPU does)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)

    vae = decoder_module(args.decoder_base_dim, DTYPES[args.dtype])
    source_bytes = sum(t.nbytes for t in vae.state_dict().values())
    compute = DTYPES[args.cpu_compute] if args.cpu_compute else None
    with cpu_computing_in(compute) if compute else contextlib.nullcontext():
        decoder = WanVAEDecoder(vae, device="cpu", local=True, backend="torch")
        prepared_bytes = sum(t.untyped_storage().nbytes() for t in decoder.weights.values())
        check = timed(decoder.sync_weights, args.repeats)
        assert not decoder.sync_weights()  # nothing changed: the check replaced nothing
        prepare = timed(lambda: (decoder.release_weights(), decoder.sync_weights()), args.repeats)
    result = {
        "command": "python bench/weight_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "decoder_base_dim": args.decoder_base_dim, "vae_dtype": args.dtype,
        "cpu_compute": args.cpu_compute or "as this CPU", "vae_decoder_bytes": source_bytes,
        "prepared_bytes": prepared_bytes, "check_seconds_median": statistics.median(check), "check_seconds": check,
        "prepare_seconds_median": statistics.median(prepare), "prepare_seconds": prepare,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
