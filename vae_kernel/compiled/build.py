"""Build a torch C++/CUDA extension on first use, through a cache that many processes can share safely.

The layout under the root (`$WAN22_VAE_DECODE_BUILD_DIR`, default `~/.cache/fastvideo/wan22_vae_decode`):

    cache/<name>-<key>/        published builds: `<name>.so` + `manifest.json` (sha256 of every file, the key inputs)
    build/<name>-<key>-<pid>-<uuid>/   one private ninja build directory per building process
    bad/                        entries that failed their manifest check, moved aside for inspection
    locks/<name>-<key>.lock     flock; only saves duplicate work
    verdicts/                   the self-checks' verdicts (`verification.py`)

Trust: the cache runs only native code this user built. Every folder is created private (0700), every file it writes
is this user's only (0600; the module 0700), and nothing is loaded, believed or waited on from a folder or file that
another user owns or that is group- or world-writable (`check_private`): such an entry is moved aside and rebuilt;
such a root or folder (a shared `$WAN22_VAE_DECODE_BUILD_DIR`, a group-writable home cache) is not used at all: the
build runs in a fresh private temporary directory, with one warning saying why.

The key hashes everything that changes the binary (sources and headers, flags, arch list, compiler versions, torch /
CUDA / Python versions, and the spec's `key_extras`: for the decoder, the CUTLASS and package versions). A build is
published by one atomic `os.rename` of a complete staging directory, so readers never see half an entry; the loser
of a race discards its copy and uses the winner's. The lock is an `flock`, which the kernel drops when its holder
dies (even by SIGKILL), and waiters give up on it after a timeout and build anyway: correctness never depends on it.

The compiler runs in a child process (`python build.py <request.json>`), so this process only ever imports the
published, verified binary. `load_extension` is generic over the extension; `extension.py` passes the decoder's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterator, Sequence

logger = logging.getLogger(__name__)

BUILD_DIR_ENV = "WAN22_VAE_DECODE_BUILD_DIR"
MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
DEFAULT_LOCK_TIMEOUT_S = 1800.0


class BuildError(RuntimeError):
    """The compiler failed; the message carries the end of its log."""


class UntrustedCache(RuntimeError):
    """A cache folder or file that another user owns or can write: nothing in or from it is loaded or believed."""


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Raise UntrustedCache unless `path` (or its already taken `st`) is this user's and nobody else can write it;
    FileNotFoundError where it does not exist."""
    st = os.stat(path) if st is None else st
    if st.st_uid != os.geteuid():
        raise UntrustedCache(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UntrustedCache(f"{path} is group- or world-writable (mode {oct(st.st_mode & 0o7777)})")


def private_folder(root: Path, name: str | None = None) -> Path:
    """`root` (or `root/name`), each created private (0700) where missing, then checked (`check_private`): the
    folders the cache keeps anything in. OSError where a missing one cannot be created (a read-only cache)."""
    folders = [root] if name is None else [root, root / name]
    for folder in folders:
        try:
            folder.mkdir(mode=0o700, parents=folder is root)
        except OSError:
            if not folder.is_dir():
                raise
        check_private(folder)
    return folders[-1]


def write_private(path: Path, text: str) -> None:
    """Replace `path` atomically by a file only this user can read or write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclasses.dataclass(frozen=True)
class ExtensionSpec:
    """What to build. `cuda_archs` are nvcc arch names (`"sm_90a"`); empty means a C++-only extension."""

    name: str
    sources: tuple[str, ...]
    depends: tuple[str, ...] = ()  # headers etc. that the sources include: hashed into the key, not compiled
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = ()
    extra_include_paths: tuple[str, ...] = ()
    cuda_archs: tuple[str, ...] = ()
    key_extras: tuple[tuple[str, str], ...] = ()  # e.g. (("cutlass", "4.2.0"),): versions of things included

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"extension name must be a Python identifier; got {self.name!r}")
        if not self.sources:
            raise ValueError(f"extension {self.name!r} needs at least one source file")
        for path in (*self.sources, *self.depends):
            if not Path(path).is_file():
                raise ValueError(f"extension {self.name!r}: source {path!r} does not exist")
        for arch in self.cuda_archs:
            if not (arch.startswith("sm_") and arch[3:].rstrip("af").isdigit()):
                raise ValueError(f"cuda arch must look like 'sm_90a'; got {arch!r}")

    @property
    def with_cuda(self) -> bool:
        return bool(self.cuda_archs) or any(s.endswith(".cu") for s in self.sources)

    def arch_flags(self) -> list[str]:
        # Explicit -gencode flags also stop torch from adding its own arch list (TORCH_CUDA_ARCH_LIST).
        return [f"-gencode=arch=compute_{a[3:]},code={a}" for a in self.cuda_archs]


def default_root() -> Path:
    configured = os.environ.get(BUILD_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path("~/.cache/fastvideo/wan22_vae_decode").expanduser()


def cuda_home() -> str | None:
    """The CUDA toolkit to compile with: $CUDA_HOME, else the directory above a real `nvcc`.

    torch's own guess follows `which nvcc`, which may be a wrapper script outside the toolkit (/usr/local/bin).
    """
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            return os.environ[env]
    candidates = [Path("/usr/local/cuda")]
    which = shutil.which("nvcc")
    if which:
        candidates.insert(0, Path(which).resolve().parent.parent)
    for home in candidates:
        if (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file():
            return str(home)
    return None


def tool_version(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    return (done.stdout + done.stderr).strip()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def key_inputs(spec: ExtensionSpec) -> dict:
    """Everything that changes the binary, as a JSON-able dict (the key is its hash). Include paths are left out:
    what they hold is named by `key_extras` (e.g. the CUTLASS version) and the hashed `depends`, so one build serves
    a checkout, its installed copy and a bare copy on a GPU machine alike."""
    import torch

    inputs = {
        "name": spec.name,
        "sources": {Path(s).name: _sha256_file(Path(s)) for s in spec.sources},
        "depends": {Path(s).name: _sha256_file(Path(s)) for s in spec.depends},
        "extra_cflags": list(spec.extra_cflags),
        "extra_cuda_cflags": list(spec.extra_cuda_cflags),
        "extra_ldflags": list(spec.extra_ldflags),
        "cuda_archs": list(spec.cuda_archs),
        "key_extras": dict(spec.key_extras),
        "host_compiler": tool_version([os.environ.get("CXX", "c++"), "--version"]),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "python": f"{sys.implementation.cache_tag}-{sys.platform}-{os.uname().machine}",
    }
    if spec.with_cuda:
        home = cuda_home()
        inputs["nvcc"] = tool_version([os.path.join(home, "bin", "nvcc"), "--version"]) if home else "missing"
    return inputs


def _key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def extension_key(spec: ExtensionSpec) -> str:
    return _key(key_inputs(spec))


# --------------------------------------------------------------------------------------------------- entries


def _module_file(name: str) -> str:
    return f"{name}.so"


def verify_entry(entry: Path, name: str, key: str) -> str | None:
    """None when `entry` is a complete, untampered build of `name` under `key`, and this user's only
    (`check_private`: the entry, its manifest and every file it lists); otherwise what is wrong."""
    try:
        check_private(entry)
        check_private(entry / MANIFEST)
        manifest = json.loads((entry / MANIFEST).read_text())
    except UntrustedCache as exc:
        return str(exc)
    except FileNotFoundError:
        return "manifest missing"
    except (OSError, ValueError) as exc:
        return f"manifest unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("name") != name:
        return "manifest names another build"
    files = manifest.get("files")
    if not isinstance(files, dict) or _module_file(name) not in files:
        return "manifest lists no module"
    for filename, expected in files.items():
        path = entry / filename
        try:
            st = path.stat()
        except OSError:
            return f"{filename} missing"
        try:
            check_private(path, st)
        except UntrustedCache as exc:
            return str(exc)
        size = st.st_size
        if size != expected.get("size") or _sha256_file(path) != expected.get("sha256"):
            return f"{filename} does not match its manifest (truncated or modified)"
    return None


def _move_aside(root: Path, entry: Path, reason: str) -> None:
    bad = root / "bad" / f"{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.warning("build cache entry %s is bad (%s); moving it to %s and rebuilding", entry, reason, bad)
    try:
        private_folder(root, "bad")
        os.rename(entry, bad)
    except FileNotFoundError:
        pass  # another process moved it first
    except OSError as exc:
        if exc.errno not in (errno.ENOENT,):
            raise


def _import_module(name: str, path: Path):
    import torch  # noqa: F401  (the extension links against libtorch, which must be loaded first)

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import extension {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _publish(root: Path, entry: Path, built: Path, spec: ExtensionSpec, key: str, inputs: dict,
             seconds: float) -> None:
    """Copy a finished build into a staging directory and rename it into place (atomic; the loser discards)."""
    staging = root / "cache" / f".staging-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(mode=0o700)
    try:
        target = staging / _module_file(spec.name)
        shutil.copyfile(built, target)
        shutil.copyfile(built.parent / BUILD_LOG, staging / BUILD_LOG)  # the compiler's report (ptxas -v, warnings)
        files = (target, staging / BUILD_LOG)
        os.chmod(target, 0o700)  # this user's only, whatever the umask (check_private)
        os.chmod(staging / BUILD_LOG, 0o600)
        manifest = {
            "name": spec.name,
            "key": key,
            "files": {f.name: {"sha256": _sha256_file(f), "size": f.stat().st_size} for f in files},
            "build_seconds": round(seconds, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "inputs": inputs,
        }
        write_private(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for path in files:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        try:
            os.rename(staging, entry)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            logger.info("another process published %s first; using its build", entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(root: Path, entry: Path, timeout_s: float) -> Iterator[None]:
    """Hold an flock while building, to avoid duplicate work. Gives up (and builds anyway) after `timeout_s`,
    and returns early once the entry appears. The kernel releases an flock when its holder dies. A lock file that
    is not this user's only is not waited on (another user must not be able to stall the build)."""
    lock_path = private_folder(root, "locks") / f"{entry.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            check_private(lock_path, os.fstat(fd))
        except UntrustedCache as exc:
            logger.warning("not waiting on the build lock: %s; building without it", exc)
            yield
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if (entry / MANIFEST).exists() or time.monotonic() > deadline:
                    if time.monotonic() > deadline:
                        logger.warning("waited %.0f s for another builder of %s; building anyway", timeout_s, entry)
                    break
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # drops the lock if held


def _build_in_child(spec: ExtensionSpec, build_dir: Path, timeout_s: float | None) -> Path:
    """Compile and link in a child process (killed after `timeout_s`); returns the built module file. The compiler's
    whole output is kept in the build directory's build.log."""
    request = dataclasses.asdict(spec)
    request["build_directory"] = str(build_dir)
    request_file = build_dir / "request.json"
    request_file.write_text(json.dumps(request))
    env = dict(os.environ)
    home = cuda_home()
    if spec.with_cuda and home:
        env["CUDA_HOME"] = home
    if "MAX_JOBS" not in env:  # nvcc needs ~3-4 GB per CUTLASS file; do not let ninja start one per core blindly
        try:
            mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError):
            mem_gb = 8.0
        env["MAX_JOBS"] = str(max(1, min(os.cpu_count() or 1, int(mem_gb // 4))))
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(request_file)], env=env,
                              capture_output=True, text=True, preexec_fn=_die_with_parent, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"building extension {spec.name} did not finish in {timeout_s:.0f} s") from exc
    log = done.stdout + done.stderr
    (build_dir / BUILD_LOG).write_text(log)
    built = build_dir / _module_file(spec.name)
    if done.returncode != 0 or not built.is_file():
        raise BuildError(f"building extension {spec.name} failed (exit {done.returncode}); "
                         f"log in {build_dir / BUILD_LOG}; its end:\n{log[-6000:]}")
    return built


def _die_with_parent() -> None:
    # The compiler child should not outlive a killed parent (PR_SET_PDEATHSIG = 1).
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except Exception:
        pass


def _writable(root: Path) -> bool:
    """Whether builds can be published under `root` (UntrustedCache where a folder is not this user's only)."""
    try:
        for sub in ("cache", "build"):
            private_folder(root, sub)
        probe = root / "cache" / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def load_extension(spec: ExtensionSpec, root: str | os.PathLike | None = None, *, lock: bool = True,
                   lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, timeout_s: float | None = None):
    """Import the extension described by `spec`, building and publishing it first if no good cached build exists."""
    root = Path(root) if root is not None else default_root()
    inputs = key_inputs(spec)
    key = _key(inputs)
    entry = root / "cache" / f"{spec.name}-{key}"

    try:
        if not _writable(root):
            with contextlib.suppress(FileNotFoundError):  # a good entry of a private read-only cache still loads
                for folder in (root, root / "cache"):
                    check_private(folder)
                if entry.is_dir() and verify_entry(entry, spec.name, key) is None:
                    return _import_module(spec.name, entry / _module_file(spec.name))
            return _private_build(spec, key, timeout_s, f"build cache {root} is not writable")
        return _load_or_build(root, entry, spec, key, inputs, lock, lock_timeout_s, timeout_s)
    except UntrustedCache as exc:
        return _private_build(spec, key, timeout_s, f"build cache {root} is not private ({exc})")


def _private_build(spec: ExtensionSpec, key: str, timeout_s: float | None, why: str):
    """Build in a fresh private temporary directory (not kept), saying `why` in one warning line."""
    warnings.warn(f"{why}; building {spec.name} in a private temporary directory (set ${BUILD_DIR_ENV} to a "
                  f"private, writable folder to keep builds)", RuntimeWarning, stacklevel=3)
    private = Path(tempfile.mkdtemp(prefix=f"{spec.name}-{key}-"))
    return _import_module(spec.name, _timed_build(spec, private, timeout_s))


def _load_or_build(root: Path, entry: Path, spec: ExtensionSpec, key: str, inputs: dict, lock: bool,
                   lock_timeout_s: float, timeout_s: float | None):
    for _attempt in range(2):
        if entry.is_dir():
            problem = verify_entry(entry, spec.name, key)
            if problem is None:
                return _import_module(spec.name, entry / _module_file(spec.name))
            _move_aside(root, entry, problem)
        lock_cm = _build_lock(root, entry, lock_timeout_s) if lock else contextlib.nullcontext()
        with lock_cm:
            if entry.is_dir() and verify_entry(entry, spec.name, key) is None:
                continue  # published while we waited
            private = private_folder(root, "build") / f"{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            private.mkdir(mode=0o700)
            start = time.monotonic()
            built = _timed_build(spec, private, timeout_s)
            _publish(root, entry, built, spec, key, inputs, time.monotonic() - start)
            shutil.rmtree(private, ignore_errors=True)
    problem = verify_entry(entry, spec.name, key)
    if problem is not None:
        raise BuildError(f"published build {entry} fails its manifest check right after building ({problem})")
    return _import_module(spec.name, entry / _module_file(spec.name))


def _timed_build(spec: ExtensionSpec, build_dir: Path, timeout_s: float | None) -> Path:
    logger.warning("building %s for %s (first use with these sources and toolchain; CUDA builds take minutes)",
                   spec.name, ", ".join(spec.cuda_archs) or "CPU")
    start = time.monotonic()
    built = _build_in_child(spec, build_dir, timeout_s)
    logger.warning("built %s in %.1f s (cold build) in %s", spec.name, time.monotonic() - start, build_dir)
    return built


def published_entry(spec: ExtensionSpec, root: str | os.PathLike | None = None) -> Path:
    """Where `spec`'s build is (or would be) published."""
    root = Path(root) if root is not None else default_root()
    return root / "cache" / f"{spec.name}-{extension_key(spec)}"


def _child_main(request_file: str) -> None:
    request = json.loads(Path(request_file).read_text())
    from torch.utils import cpp_extension

    spec = ExtensionSpec(**{f.name: tuple(request[f.name]) if isinstance(request[f.name], list) else request[f.name]
                            for f in dataclasses.fields(ExtensionSpec)})
    cpp_extension.load(
        name=spec.name,
        sources=list(spec.sources),
        extra_cflags=list(spec.extra_cflags),
        extra_cuda_cflags=[*spec.arch_flags(), *spec.extra_cuda_cflags],
        extra_ldflags=list(spec.extra_ldflags),
        extra_include_paths=list(spec.extra_include_paths),
        build_directory=request["build_directory"],
        verbose=True,  # the compiler's output (ptxas -v) into the parent's build.log
        with_cuda=spec.with_cuda,
        is_python_module=True,  # also proves the module imports (on a GPU-less machine too)
    )


if __name__ == "__main__":
    _child_main(sys.argv[1])
