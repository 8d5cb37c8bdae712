"""Verifying a built extension on its GPU before anything decodes with it: the self-check runs in a child process, so
a kernel that faults (a sticky CUDA error poisons a process's context) cannot take the caller's context, and with it
the portable fallback, down. The verdict, pass or failure, is remembered in the build cache (`verdicts/`), per build,
GPU model, driver and torch, so later processes skip the child: a pass loads the table, a failure refuses it again
with the remembered reason (`remembered_verdict`). A failed verdict holds while its key does, i.e. until the build
(sources, flags, toolchain, package version), the GPU model, the driver or torch changes; deleting its file (named in
the refusal), or the whole `verdicts/` folder, makes the next process check again. A crash or a timeout of the check
is a failure like any other: a faulting or hung kernel would fault or hang again (on a machine too loaded to finish
the check in time, delete the file). Verdicts are kept in the cache this process uses (`build.root_in_use`) and
read as its entries are (`build.read_private`): one that another user owns or could have written or replaced is not
believed.

The child is started with the package's own location first on its path, whatever the caller's working directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import build
from .extension import CompiledUnavailable, ExtensionSource
from .kernels import make_ops
from ..portable.ops import Ops
from .selfcheck import CaseResult, coverage, self_check

logger = logging.getLogger(__name__)

SELF_CHECK_TIMEOUT_S = 300.0
_RESULT_TAG = "SELF_CHECK_JSON "


def package_root() -> str:
    """The directory holding the `fastvideo_pan2_ext` package this module was imported from (a checkout's root, or
    site-packages)."""
    return str(Path(sys.modules[__name__.partition(".")[0]].__file__).parent.parent)


def child_command(module: str, *args: str, path: str | None = None) -> list[str]:
    """`python -c` running `module.child_main(args)` with this package first on the path (not the cwd's copy), and
    `path` after it."""
    paths = [package_root(), *([path] if path else [])]
    code = (f"import sys; sys.path[0:0] = {paths!r}; "
            f"from {module} import child_main; child_main(sys.argv[1:])")
    return [sys.executable, "-c", code, *args]


def tagged_line(tag: str, value) -> str:
    """A child process's answer: one stdout line, `tag` then the JSON of `value` (it may log anything around it)."""
    return tag + json.dumps(value, default=str)


def last_tagged(tag: str, stdout: str):
    """The value of the last `tagged_line(tag, ...)` in a child's stdout; None if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(tag)]
    return json.loads(lines[-1][len(tag):]) if lines else None


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


def verdict_path(ext, device: torch.device, winograd: bool = False) -> Path:
    """Where the verdict of `ext`'s self-check on `device` is kept: under the build cache this process uses
    (`build.root_in_use`), keyed by the extension (a built module's file names its build key), the device model, its
    driver, torch, and what the self-check covers (`selfcheck.coverage`: a verdict of a check that covered less, e.g.
    before it covered the encoders, is never taken for this one)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_id = [props.name, list(torch.cuda.get_device_capability(device)), driver_version()]
    else:
        device_id = [device.type]
    key = hashlib.sha256(json.dumps([ext.arch(), getattr(ext, "__file__", type(ext).__name__), winograd, *device_id,
                                     torch.version.cuda, torch.__version__, coverage()]).encode()).hexdigest()[:16]
    return build.root_in_use() / "verdicts" / f"selfcheck-{key}.json"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A remembered self-check verdict: passed or not, its cases (none where the check crashed or timed out), the
    failure as it was raised (empty for a pass), when it was reached and the file it is kept in."""

    ok: bool
    results: tuple[CaseResult, ...]
    failure: str
    created: str
    path: Path

    def refusal(self) -> str:
        """Why the compiled backend is refused, naming the remembered failure and how to check again."""
        return (f"remembered self-check verdict ({self.created}, {self.path}; delete that file to check again): "
                f"{self.failure}")


def remembered_verdict(ext, device: torch.device | str, winograd: bool = False) -> Verdict | None:
    """The verdict remembered for `ext` on `device` (see the module notes), or None: none kept, unreadable, or kept
    where another user could have written or replaced it (`build.read_private`; such a verdict is not believed)."""
    return _read_verdict(verdict_path(ext, torch.device(device), winograd))


def _read_verdict(path: Path) -> Verdict | None:
    try:
        data = json.loads(build.read_private(path.parent.parent, path.parent.name, path.name))
        verdict = Verdict(ok=data["ok"] is True, results=tuple(CaseResult.from_json(r) for r in data["results"]),
                          failure=str(data["failure"]), created=str(data["created"]), path=path)
    except FileNotFoundError:
        return None
    except build.UntrustedCache as exc:
        logger.warning("not believing the self-check verdict %s: %s", path, exc)
        return None
    except (OSError, ValueError, TypeError, KeyError):
        return None  # unreadable (or another version's format): check again
    if verdict.ok and not (verdict.results and all(r.ok for r in verdict.results)):
        return None  # a pass must show passing cases
    return verdict


def _remember(path: Path, results: list[CaseResult], failure: str) -> None:
    """Keep a verdict (atomically, this user's only); a cache that is read-only or not private only means checking
    again next time."""
    data = {"ok": not failure, "results": [r.to_json() for r in results], "failure": failure,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        build.private_folder(path.parent.parent, path.parent.name)
        build.write_private(path, json.dumps(data))
    except (OSError, build.UntrustedCache) as exc:
        logger.warning("the self-check verdict is not remembered (%s)", exc)


def verify_build_isolated(source: ExtensionSource, device: torch.device, winograd: bool = False,
                          timeout_s: float = SELF_CHECK_TIMEOUT_S) -> list[CaseResult]:
    """Self-check the op table of the extension from `source` on `device` in a child process that opens it again (see
    the module notes), with its (kt, 3, 3) convs by the Winograd kernels if `winograd`; returns the results or raises
    CompiledUnavailable. A remembered verdict answers without the child: a pass returns its cases, a failure is
    raised again."""
    ext = source.open()  # built: from the cache (the module this process imported, if it did)
    what = f"compiled kernels ({ext.arch()}{' + Winograd F(2x2)' if winograd else ''})"
    path = verdict_path(ext, device, winograd)
    remembered = _read_verdict(path)
    if remembered is not None and not remembered.ok:
        raise CompiledUnavailable(remembered.refusal())
    if remembered is not None:
        judge(list(remembered.results), f"{what}, remembered verdict", device)
        return list(remembered.results)
    results: list[CaseResult] = []
    try:
        results = _check_in_child(source, device, winograd, timeout_s, what)
        judge(results, what, device)
    except CompiledUnavailable as exc:
        _remember(path, results, str(exc))
        raise
    _remember(path, results, "")
    return results


def _check_in_child(source: ExtensionSource, device: torch.device, winograd: bool, timeout_s: float,
                    what: str) -> list[CaseResult]:
    try:
        # The child uses this process's cache, so it opens the build this process loaded (where the configured
        # cache was unusable: this process's private one) instead of building again.
        env = {**os.environ, build.BUILD_DIR_ENV: str(build.root_in_use())}
        done = subprocess.run(child_command(__name__, str(device), str(int(winograd)), *source.to_argv(),
                                            path=source.path),
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise CompiledUnavailable(f"the self-check of the {what} on {device} did not finish in "
                                  f"{timeout_s:.0f} s") from exc
    answer = last_tagged(_RESULT_TAG, done.stdout)
    if done.returncode != 0 or answer is None:
        raise CompiledUnavailable(f"the self-check of the {what} on {device} crashed "
                                  f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [CaseResult.from_json(r) for r in answer]


def child_main(argv: list[str]) -> None:
    """In the child: open the extension from the source in argv[2:] (`ExtensionSource.to_argv`; built: from the
    cache), self-check its op table (Winograd convs if argv[1] is "1") on device argv[0], print the results."""
    device = torch.device(argv[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ext = ExtensionSource.from_argv(argv[2:]).open()
    results = self_check(make_ops(ext, winograd_convs=argv[1] == "1"), device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(tagged_line(_RESULT_TAG, [r.to_json() for r in results]), flush=True)


def driver_version() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
