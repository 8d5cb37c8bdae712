"""Verifying a built extension on its GPU before anything decodes with it: the self-check runs in a child process, so
a kernel that faults (a sticky CUDA error poisons a process's context) cannot take the caller's context, and with it
the portable fallback, down. A passing verdict is remembered in the build cache (`verdicts/`), per build, GPU model,
driver and torch, so later processes skip the child.

The child is started with the package's own location first on its path, whatever the caller's working directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from . import build
from .extension import CompiledUnavailable, open_extension
from .kernels import make_ops
from ..portable.ops import Ops
from .selfcheck import CaseResult, self_check

logger = logging.getLogger(__name__)

SELF_CHECK_TIMEOUT_S = 300.0
_RESULT_TAG = "SELF_CHECK_JSON "


def package_root() -> str:
    """The directory holding the `fastvideo_pan2_ext` package this module was imported from (a checkout's root, or
    site-packages)."""
    return str(Path(sys.modules[__name__.partition(".")[0]].__file__).parent.parent)


def child_command(module: str, *args: str) -> list[str]:
    """`python -c` running `module.child_main(args)` with this package first on the path (not the cwd's copy)."""
    code = (f"import sys; sys.path.insert(0, {package_root()!r}); "
            f"from {module} import child_main; child_main(sys.argv[1:])")
    return [sys.executable, "-c", code, *args]


def judge(results: list[CaseResult], what: str, device) -> None:
    """Raise CompiledUnavailable unless every case is within the allowance (the message lists every case); warn
    about calls that ran on the portable op."""
    if not results or not all(r.ok for r in results):
        detail = "\n  ".join(str(r) for r in results) or "no results"
        raise CompiledUnavailable(f"{what} failed the runtime self-check on {device}:\n  {detail}")
    fell = {k: v for r in results for k, v in r.fallbacks.items()}
    if fell:
        logger.warning("%s: some decoder op shapes run on the portable op, not the compiled kernels: %s", what, fell)
    logger.info("%s passed the self-check on %s:\n  %s", what, device, "\n  ".join(map(str, results)))


def verify_ops(table: Ops, device: torch.device) -> None:
    """Self-check `table` in this process; CompiledUnavailable when outside the allowance."""
    judge(self_check(table, device), f"op table {table.name}", device)


def _verdict_file(ext, device: torch.device, winograd: bool) -> Path:
    """Where a passing verdict is kept: under the build cache, keyed by the extension (a built module's file names
    its build key), the device model, its driver and torch."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_id = [props.name, list(torch.cuda.get_device_capability(device)), driver_version()]
    else:
        device_id = [device.type]
    key = hashlib.sha256(json.dumps([ext.arch(), getattr(ext, "__file__", type(ext).__name__), winograd, *device_id,
                                     torch.version.cuda, torch.__version__]).encode()).hexdigest()[:16]
    return build.default_root() / "verdicts" / f"selfcheck-{key}.json"


def verify_build_isolated(ext, device: torch.device, winograd: bool = False,
                          timeout_s: float = SELF_CHECK_TIMEOUT_S) -> list[CaseResult]:
    """Self-check the built extension's op table on `device` in a child process (see the module notes), with its
    (kt, 3, 3) convs by the Winograd kernels if `winograd`; returns the results or raises CompiledUnavailable."""
    arch = ext.arch() + (" + Winograd F(2x2)" if winograd else "")
    verdict = _verdict_file(ext, device, winograd)
    if verdict.is_file():
        try:
            results = [CaseResult.from_json(r) for r in json.loads(verdict.read_text())]
            judge(results, f"compiled kernels ({arch}, remembered verdict)", device)
            return results
        except (ValueError, TypeError, KeyError, CompiledUnavailable):
            pass  # unreadable or failing: check again
    try:
        done = subprocess.run(child_command(__name__, str(device), ext.arch(), str(int(winograd))),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CompiledUnavailable(f"the self-check of the compiled kernels on {device} did not finish in "
                                  f"{timeout_s:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_TAG)]
    if done.returncode != 0 or not lines:
        raise CompiledUnavailable(f"the self-check of the compiled kernels ({arch}) on {device} crashed "
                                  f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    results = [CaseResult.from_json(r) for r in json.loads(lines[-1][len(_RESULT_TAG):])]
    judge(results, f"compiled kernels ({arch})", device)
    try:  # remember the pass (atomically); a read-only cache only means checking again next time
        verdict.parent.mkdir(parents=True, exist_ok=True)
        tmp = verdict.with_name(f".{verdict.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([r.to_json() for r in results]))
        os.replace(tmp, verdict)
    except OSError:
        pass
    return results


def child_main(argv: list[str]) -> None:
    """In the child: open the extension for argv[1] (built: from the cache), self-check its op table (Winograd convs
    if argv[2] is "1") on device argv[0], print the results."""
    device = torch.device(argv[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = self_check(make_ops(open_extension(argv[1]), winograd_convs=argv[2] == "1"), device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(_RESULT_TAG + json.dumps([r.to_json() for r in results]), flush=True)


def driver_version() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
