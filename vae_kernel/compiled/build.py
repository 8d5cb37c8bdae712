"""Build a torch C++/CUDA extension on first use, through a cache that many processes can share safely.

The layout under the root (`$WAN22_VAE_DECODE_BUILD_DIR`, default `~/.cache/fastvideo/wan22_vae_decode`):

    cache/<name>-<key>/        published builds: `<name>.so` + `manifest.json` (sha256 of every file, the key inputs)
    build/<name>-<key>-<pid>-<uuid>/   one private ninja build directory per building process, and its `.lock`
                                (flock held while it builds: a dead builder's folder is removed by the next build)
    bad/                        entries that failed their manifest check, moved aside for inspection
    locks/<name>-<key>.lock     flock; only saves duplicate work
    verdicts/                   the self-checks' verdicts (`verification.py`)

Trust: the cache runs only native code this user built, and loads the very bytes it verified. The root is reached
from `/` one folder at a time through open descriptors, never following a link (`open_folder`): every folder above
it must be this user's or root's and writable by nobody else, or sticky with the next folder this user's or root's
(`check_parent`: nobody else can rename or replace it); the root and everything in it must be this user's and
writable by nobody else (`check_private`). An entry's manifest and files are opened through the root's descriptor,
checked and hashed through their own, and the module is loaded from that descriptor (`/proc/self/fd/N`): swapping a
folder or a link between check and load changes nothing. Folders the cache creates are 0700 and its files 0600 (the
module 0700) whatever the umask. A bad entry is moved aside and rebuilt; a root that fails the rule (a shared
`$WAN22_VAE_DECODE_BUILD_DIR`, a group-writable home), or cannot be written and holds no good entry, is not used at
all: the process builds once into its own private temporary cache, removed at exit, shared by its later loads and its
self-check children (`root_in_use`), and says so in one warning.

The key hashes everything that changes the binary (sources and headers, flags, arch list, compiler versions, torch /
CUDA / Python versions, and the spec's `key_extras`: for the decoder, the CUTLASS and package versions). A build is
published by one atomic `os.rename` of a complete staging directory, so readers never see half an entry; the loser
of a race discards its copy and uses the winner's. The lock is an `flock`, which the kernel drops when its holder
dies (even by SIGKILL), and waiters give up on it after a timeout and build anyway: correctness never depends on it.

The compiler runs in a child process (`python build.py <request.json>`), so this process only ever imports the
published, verified binary. `load_extension` is generic over the extension; `extension.py` passes the decoder's.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
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


def check_parent(path: Path, st: os.stat_result, child_uid: int) -> None:
    """Raise UntrustedCache unless nobody but this user or root can rename or replace the entry, owned by
    `child_uid`, of the folder `path` (its stat `st`): the folder is this user's or root's, and nobody else can write
    it, or it is sticky (like /tmp) and the entry is this user's or root's."""
    trusted = (os.geteuid(), 0)
    if st.st_uid not in trusted:
        raise UntrustedCache(f"{path}, a folder above the build cache, is owned by uid {st.st_uid}, not by this user "
                             f"(uid {os.geteuid()}) or root")
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and child_uid in trusted):
        raise UntrustedCache(f"{path}, a folder above the build cache, is group- or world-writable "
                             f"(mode {oct(st.st_mode & 0o7777)})")


_FOLDER = os.O_PATH | os.O_DIRECTORY  # a handle to walk through and fstat: needs search permission only


def _unopenable(path: Path, exc: OSError) -> UntrustedCache:
    # Only another user's file or folder (or root's, copied in) can refuse this user: not this user's only.
    return UntrustedCache(f"{path} cannot be opened by this user ({exc.strerror}): another user's")


def _open_private(dir_fd: int, name: str, path: Path, flags: int) -> int:
    """`name` in the open folder `dir_fd` (it is `path`), opened without following a link and checked
    (`check_private`); UntrustedCache for a link, a wrong kind or one this user cannot open, FileNotFoundError where
    it is missing. A file is first taken by an O_PATH handle, which opens nothing: only a regular file of this
    user's is then opened (a FIFO would block the open, a device act on it)."""
    folder = bool(flags & os.O_DIRECTORY)
    try:
        fd = os.open(name, (flags if folder else os.O_PATH) | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedCache(f"{path} is a symbolic link or not a {'folder' if folder else 'file'}") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise _unopenable(path, exc) from None
        raise
    try:
        st = os.fstat(fd)
        if not folder and not stat.S_ISREG(st.st_mode):  # O_PATH with O_NOFOLLOW takes a link itself
            raise UntrustedCache(f"{path} is a symbolic link or not a file")
        check_private(path, st)
        if not folder and not flags & os.O_PATH:
            try:  # the very inode checked, through its handle (whatever `name` is now)
                opened = os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
            except PermissionError as exc:
                raise _unopenable(path, exc) from None
            os.close(fd)
            fd = opened
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_folder(root: Path, create: bool = False) -> int:
    """An open descriptor of the cache folder `root`, reached from `/` one folder at a time without following a link
    (the real path of `root` is taken once): every folder above it passes `check_parent`, `root` `check_private`.
    Missing folders are created 0700 whatever the umask where `create`, else FileNotFoundError. The caller closes
    it; UntrustedCache names the folder that fails."""
    real = Path(os.path.realpath(root))
    fd = os.open("/", _FOLDER | os.O_CLOEXEC)
    try:
        path, st = Path("/"), os.fstat(fd)
        for part in real.parts[1:]:
            child = path / part
            try:
                child_fd = os.open(part, _FOLDER | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                check_parent(path, st, os.geteuid())  # never create anything in a folder others control
                with contextlib.suppress(FileExistsError):  # another process made it first: judged below
                    os.mkdir(part, 0o700, dir_fd=fd)
                    os.chmod(part, 0o700, dir_fd=fd)  # the umask may have taken bits off
                child_fd = os.open(part, _FOLDER | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except NotADirectoryError:  # a link put in since the real path was taken, or a file
                raise UntrustedCache(f"{child} is a symbolic link or not a folder") from None
            os.close(fd)
            fd = child_fd
            child_st = os.fstat(fd)
            if not stat.S_ISDIR(child_st.st_mode):
                raise UntrustedCache(f"{child} is a symbolic link or not a folder")
            check_parent(path, st, child_st.st_uid)
            path, st = child, child_st
        check_private(path, st)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_private(root: Path, *names: str) -> bytes:
    """The bytes of the file `root/names[0]/.../names[-1]`, read through descriptors: `root` by `open_folder`, every
    folder and the file below it checked (`check_private`). UntrustedCache or FileNotFoundError where not."""
    fds = [open_folder(root)]
    try:
        path = Path(root)
        for i, name in enumerate(names):
            path = path / name
            fds.append(_open_private(fds[-1], name, path, os.O_RDONLY if i == len(names) - 1 else _FOLDER))
        return _read_fd(fds[-1])
    finally:
        for fd in fds:
            os.close(fd)


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.pread(fd, 1 << 20, sum(map(len, chunks))):
        chunks.append(chunk)
    return b"".join(chunks)


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
    """None when `entry` is a complete, untampered build of `name` under `key`, this user's only; otherwise what is
    wrong (`open_entry`)."""
    cache_fd = os.open(entry.parent, _FOLDER | os.O_CLOEXEC)
    try:
        found = open_entry(cache_fd, entry, name, key)
    finally:
        os.close(cache_fd)
    if isinstance(found, int):
        os.close(found)
        return None
    return found or "missing"


def open_entry(cache_fd: int, entry: Path, name: str, key: str) -> int | str | None:
    """The module file of the published build `entry` in the open cache folder `cache_fd`, opened and verified
    through its descriptor: the entry, its manifest and every file it lists are this user's only (`check_private`),
    not links, and match the manifest (size, sha256), which names this build. Returns that open descriptor (the
    caller loads or closes it), what is wrong with the entry, or None where there is none."""
    fds: list[int] = []
    try:
        try:
            fds.append(_open_private(cache_fd, entry.name, entry, _FOLDER))
        except FileNotFoundError:
            return None
        entry_fd = fds[0]
        try:
            fds.append(_open_private(entry_fd, MANIFEST, entry / MANIFEST, os.O_RDONLY))
            manifest = json.loads(_read_fd(fds[-1]))
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
            if not isinstance(expected, dict) or Path(filename).name != filename:
                return f"manifest entry {filename!r} is malformed"
            try:
                fd = _open_private(entry_fd, filename, entry / filename, os.O_RDONLY)
            except FileNotFoundError:
                return f"{filename} missing"
            fds.append(fd)
            try:
                data = _read_fd(fd)
            except OSError as exc:
                return f"{filename} unreadable ({exc})"
            if len(data) != expected.get("size") or hashlib.sha256(data).hexdigest() != expected.get("sha256"):
                return f"{filename} does not match its manifest (truncated or modified)"
            if filename == _module_file(name):
                module_fd = fd
        fds.remove(module_fd)  # verified: the caller's to load
        return module_fd
    except UntrustedCache as exc:
        return str(exc)
    finally:
        for fd in fds:
            os.close(fd)


def _move_aside(root: Path, entry: Path, reason: str) -> None:
    """Move the bad `entry` into `bad/`; UntrustedCache where this user cannot (another user's folder: the root then
    holds what this user does not control, and the process builds privately)."""
    bad = root / "bad" / f"{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.warning("build cache entry %s is bad (%s); moving it to %s and rebuilding", entry, reason, bad)
    try:
        private_folder(root, "bad")
        os.rename(entry, bad)
    except FileNotFoundError:
        pass  # another process moved it first
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UntrustedCache(f"{entry} is bad ({reason}) and cannot be moved aside ({exc.strerror})") from None
        raise


_kept_fds: list[int] = []  # the descriptors loaded modules came from, open for the process's life


def _import_module(name: str, fd: int, path: Path):
    """Import the extension module `name` from the open, verified file `fd` (it was `path`; whatever `path` names now
    is not read). The descriptor stays open: the dynamic loader knows the library as /proc/self/fd/N and would hand
    it out again for a later library opened under that name."""
    import torch  # noqa: F401  (the extension links against libtorch, which must be loaded first)

    try:
        origin = f"/proc/self/fd/{fd}"
        loader = importlib.machinery.ExtensionFileLoader(name, origin)
        spec = importlib.util.spec_from_file_location(name, origin, loader=loader)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException:
        os.close(fd)
        raise
    _kept_fds.append(fd)
    module.__file__ = str(path)  # where the loaded bytes were verified (its folder names the build key)
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


class _NotWritable(Exception):
    """The cache cannot take a new build (and holds no good one)."""


_process_lock = threading.Lock()
_modules: dict[tuple[Path, str, str], object] = {}  # (root asked for, name, key) -> the module this process loaded
_in_use: dict[Path, Path] = {}  # a root this process cannot use -> the private cache it uses instead
_private: list[Path] = []  # this process's private cache, once made


def root_in_use(root: str | os.PathLike | None = None) -> Path:
    """The cache this process uses for `root` (default: `default_root()`): `root` itself, or this process's private
    one where `root` was found untrusted or read-only. Self-check children are pointed at it, so they load this
    process's build instead of building again; the verdicts are kept in it."""
    root = Path(root) if root is not None else default_root()
    return _in_use.get(root, root)


def load_extension(spec: ExtensionSpec, root: str | os.PathLike | None = None, *, lock: bool = True,
                   lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, timeout_s: float | None = None):
    """Import the extension described by `spec` from the cache under `root`, building and publishing it first if
    no good build is there (see the module notes). Once per process: later calls return the same module."""
    root = Path(root) if root is not None else default_root()
    inputs = key_inputs(spec)
    key = _key(inputs)
    with _process_lock:
        if (root, spec.name, key) not in _modules:
            args = (spec, key, inputs, lock, lock_timeout_s, timeout_s)
            try:
                module = _load_or_build(root_in_use(root), *args)
            except (UntrustedCache, _NotWritable) as exc:
                if root in _in_use:
                    raise  # this process's private cache itself failed
                why = "is not private" if isinstance(exc, UntrustedCache) else "is not writable"
                _in_use[root] = _private_cache(f"build cache {root} {why} ({exc})")
                module = _load_or_build(_in_use[root], *args)
            _modules[(root, spec.name, key)] = module
        return _modules[(root, spec.name, key)]


def _private_cache(why: str) -> Path:
    """This process's private cache (made once in the temporary folder, removed at exit), saying `why` in one
    warning line."""
    warnings.warn(f"{why}; building in a private temporary folder removed at exit (set ${BUILD_DIR_ENV} to a "
                  f"private, writable folder to keep builds)", RuntimeWarning, stacklevel=4)
    if not _private:
        _private.append(Path(tempfile.mkdtemp(prefix="wan22_vae_decode-")))
        atexit.register(_remove_private, _private[0], os.getpid())
    return _private[0]


def _remove_private(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that exits through Python
        shutil.rmtree(folder, ignore_errors=True)


def _load_or_build(root: Path, spec: ExtensionSpec, key: str, inputs: dict, lock: bool, lock_timeout_s: float,
                   timeout_s: float | None):
    """The verified module of the entry for `key` under `root`, built and published first where it is missing or bad.
    UntrustedCache where `root` or its cache folder fails the trust rule; _NotWritable where a build is needed and
    cannot be published."""
    root = Path(os.path.realpath(root))  # every later path is under folders nobody else can replace (open_folder)
    entry = root / "cache" / f"{spec.name}-{key}"
    try:
        root_fd = open_folder(root, create=True)
    except OSError as exc:  # a missing folder that cannot be made
        raise _NotWritable(f"{exc.filename or root}: {exc.strerror}") from exc
    try:
        for attempt in range(3):
            try:
                cache_fd = _open_private(root_fd, "cache", entry.parent, _FOLDER)
            except FileNotFoundError:
                found = None
            else:
                try:
                    found = open_entry(cache_fd, entry, spec.name, key)
                finally:
                    os.close(cache_fd)
            if isinstance(found, int):
                return _import_module(spec.name, found, entry / _module_file(spec.name))
            if attempt == 2:
                raise BuildError(f"published build {entry} fails its check right after building ({found})")
            if not _writable(root):
                raise _NotWritable("no write permission")
            if found is not None:
                _move_aside(root, entry, found)
            with _build_lock(root, entry, lock_timeout_s) if lock else contextlib.nullcontext():
                if not (entry / MANIFEST).exists():  # else published while we waited: check it
                    _build_and_publish(root, entry, spec, key, inputs, timeout_s)
    finally:
        os.close(root_fd)


def _build_and_publish(root: Path, entry: Path, spec: ExtensionSpec, key: str, inputs: dict,
                       timeout_s: float | None) -> None:
    builds = private_folder(root, "build")
    remove_dead_builds(builds)
    private = _build_folder(builds, entry)
    lock_fd = _hold_build_lock(private)
    try:
        private.mkdir(mode=0o700)
        start = time.monotonic()
        built = _timed_build(spec, private, timeout_s)
        _publish(root, entry, built, spec, key, inputs, time.monotonic() - start)
    finally:
        shutil.rmtree(private, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(_build_lock_path(private))
        os.close(lock_fd)


def _build_lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + ".lock")


def _build_folder(builds: Path, entry: Path) -> Path:
    """A new build folder's path for `entry` (not made yet): `<entry>-<this pid>-<random>` (`_builder_pid`)."""
    return builds / f"{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _builder_pid(lock_path: Path) -> int | None:
    """The builder's pid in the name of its folder's lock (`_build_folder`), or None."""
    parts = lock_path.name[:-len(".lock")].rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _hold_build_lock(folder: Path) -> int:
    """The held lock of the build folder `folder`, made and flocked before the folder exists, for as long as this build
    lives (the kernel drops it when this process dies, even by SIGKILL): a folder whose lock is free is a dead
    builder's (`remove_dead_builds`). Between its creation and its flock the lock is free: a remover that cannot see
    this pid (another pid namespace sharing the cache) may take it for a dead builder's and remove it, so once held
    it must still be the file at its name, else it is made again."""
    path = _build_lock_path(folder)
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            named = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            named = None
        held = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)
    raise OSError(f"cannot hold the build lock {path}: removed 100 times as soon as it was made")


def remove_dead_builds(builds: Path) -> list[Path]:
    """Remove the build folders under `builds` (private: `private_folder`) whose builder died mid-build, each told by
    its lock (`_hold_build_lock`): a lock no process holds. A live builder's lock cannot be taken, so its folder
    stays; a folder without a lock (made before locks were) is left as it is. A free lock without its folder is a
    builder's that died between the two, or one's about to flock it: removed only when the pid in its name is no
    live process. Returns what was removed: each folder, and each lock that was left without one."""
    removed = []
    for lock_path in sorted(builds.glob("*.lock")):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone (its builder finished), or not a plain file: not ours to judge
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live builder's
            folder = lock_path.with_name(lock_path.name[:-len(".lock")])
            if os.path.lexists(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
                logger.info("removed %s, the build folder of a builder that died mid-build", folder)
            else:
                pid = _builder_pid(lock_path)
                if pid is None or _alive(pid):  # maybe a builder between its lock and its flock: never removed
                    continue
                removed.append(lock_path)
                logger.info("removed %s, the lock of a builder that died before making its folder", lock_path)
            lock_path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


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
