"""The build cache (vae_kernel/compiled/build.py) under real processes, with a tiny C++ extension through the same code path.

Every builder here is a real Python process running `load_extension`; builds are real (torch's cpp_extension + ninja
+ the host compiler), about 15-20 s each on 2 cores, so tests share one raced build where that is honest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fastvideo_pan2_ext.vae_kernel.compiled import build

pytestmark = pytest.mark.slow  # real compiles racing each other

TINY_SOURCE = """
#include <pybind11/pybind11.h>
#include <string>
static int add(int a, int b) { return a + b + TINY_OFFSET; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add", &add);
  m.def("arch", [] { return std::string("tiny"); });  // enough of the decoder extension's API to reach its self-check
}
"""

# One builder process: loads the extension through the cache and prints what it got as one JSON line.
BUILDER = """
import hashlib, json, sys
from fastvideo_pan2_ext.vae_kernel.compiled import build
root, source, offset, lock = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
spec = build.ExtensionSpec(name="tiny_cache_ext", sources=(source,), extra_cflags=(f"-DTINY_OFFSET={offset}",))
module = build.load_extension(spec, root=root, lock=lock)
print(json.dumps({"file": module.__file__, "sha256": hashlib.sha256(open(module.__file__, "rb").read()).hexdigest(),
                  "sum": module.add(2, 3)}))
"""


# The tiny extension as the loader's source (an importable module), counting every compile of the process that
# imports it: the loader's process and its self-check child alike.
COUNTED_SOURCE = """
import os
from fastvideo_pan2_ext.vae_kernel.compiled import build
compile_ = build._build_in_child
def counted(*args, **kwargs):
    with open(os.environ["TINY_COMPILES"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    return compile_(*args, **kwargs)
build._build_in_child = counted
def open_tiny(source, offset):
    return build.load_extension(build.ExtensionSpec(name="tiny_cache_ext", sources=(source,),
                                                    extra_cflags=(f"-DTINY_OFFSET={offset}",)))
"""

# Loads the compiled op table from the tiny extension, as a decoder does (self-check child included), on the cache
# of $WAN22_VAE_DECODE_BUILD_DIR; the tiny extension has no kernels, so its self-check fails.
TABLE_LOADER = """
import json, os, sys
from fastvideo_pan2_ext.vae_kernel.compiled import loader
from fastvideo_pan2_ext.vae_kernel.compiled.extension import CompiledUnavailable, ExtensionSource
sys.path.insert(0, sys.argv[3])  # where the source's module is (the self-check child is given it too)
try:
    loader.load_ops("cpu", source=ExtensionSource("counted_source", "open_tiny", tuple(sys.argv[1:3]), sys.argv[3]))
    error = None
except CompiledUnavailable as exc:
    error = str(exc)
print(json.dumps({"pid": os.getpid(), "error": error}))
"""

def _env() -> dict:
    env = dict(os.environ)
    env["MAX_JOBS"] = "1"
    env.pop(build.BUILD_DIR_ENV, None)
    return env


def _start(root: Path, source: Path, offset: int, lock: bool = True, prefix: list[str] = (),
           **kwargs) -> subprocess.Popen:
    command = [*prefix, sys.executable, "-c", BUILDER, str(root), str(source), str(offset), "1" if lock else "0"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), **kwargs)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"builder failed (exit {proc.returncode}):\n{err[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    return result


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "cache").iterdir() if not p.name.startswith("."))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny.cpp"
    path.write_text(TINY_SOURCE)
    return path


@pytest.fixture(scope="module")
def raced(tmp_path_factory, source):
    """8 processes started together on one empty cache and one key (with the lock, as in production)."""
    root = tmp_path_factory.mktemp("raced")
    offset = 1000 + uuid.uuid4().int % 1000  # a key no earlier run has seen
    procs = [_start(root, source, offset) for _ in range(8)]
    return root, offset, [_finish(p) for p in procs]


def test_eight_racing_processes_all_succeed_and_agree_on_one_published_build(raced):
    root, offset, results = raced
    (entry,) = _entries(root)
    assert {r["file"] for r in results} == {str(entry / "tiny_cache_ext.so")}
    assert len({r["sha256"] for r in results}) == 1
    assert all(r["sum"] == 5 + offset for r in results)
    assert not list((root / "cache").glob(".staging-*")), "a staging directory was left behind"
    assert not list((root / "build").iterdir()), "a private build directory was left behind"
    assert build.verify_entry(entry, "tiny_cache_ext", entry.name.rsplit("-", 1)[1]) is None


def test_racing_processes_without_the_lock_still_agree_on_one_published_build(tmp_path, source):
    offset = 3000 + uuid.uuid4().int % 1000
    procs = [_start(tmp_path, source, offset, lock=False) for _ in range(2)]
    results = [_finish(p) for p in procs]
    (entry,) = _entries(tmp_path)
    assert {r["file"] for r in results} == {str(entry / "tiny_cache_ext.so")}
    assert all(r["sum"] == 5 + offset for r in results)
    assert not list((tmp_path / "cache").glob(".staging-*"))


def test_builder_killed_mid_build_never_blocks_the_next_process_which_removes_its_folder(tmp_path, source):
    offset = 5000 + uuid.uuid4().int % 1000
    victim = _start(tmp_path, source, offset, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "build").glob("*/build.ninja")):  # torch has written its ninja file: compiling now
        assert victim.poll() is None, "builder finished before it could be killed"
        assert time.monotonic() < deadline, "builder never started compiling"
        time.sleep(0.05)
    (folder,) = [p for p in (tmp_path / "build").iterdir() if p.is_dir()]
    assert build.remove_dead_builds(tmp_path / "build") == [] and folder.is_dir()  # a live builder's: its lock held
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not _entries(tmp_path), "a killed builder published something"
    start = time.monotonic()
    result = _finish(_start(tmp_path, source, offset), timeout=240)
    assert result["sum"] == 5 + offset
    assert Path(result["file"]).parent in _entries(tmp_path)
    # It built (it did not wait out the lock timeout, which is 30 minutes).
    assert time.monotonic() - start < 200
    assert not list((tmp_path / "build").iterdir()), "the killed builder's folder (or its lock) was left behind"


# A builder that makes its folder's lock as a build does, then is killed before the build makes the folder.
LOCK_ONLY_BUILDER = """
import os, signal, sys
from pathlib import Path
from fastvideo_pan2_ext.vae_kernel.compiled import build
build._hold_build_lock(build._build_folder(Path(sys.argv[1]), Path("tiny_cache_ext-key")))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_lock_left_without_its_folder_is_removed_when_its_builder_is_dead_never_when_alive(tmp_path):
    builds = build.private_folder(tmp_path, "build")
    killed = subprocess.Popen([sys.executable, "-c", LOCK_ONLY_BUILDER, str(builds)], env=_env(),
                              stderr=subprocess.PIPE, text=True)
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    (dead,) = builds.iterdir()
    assert build._builder_pid(dead) == killed.pid and dead.name.endswith(".lock")
    # Live builders: one between making its lock and holding it (this process's pid; the lock free), one holding it.
    between = build._build_lock_path(build._build_folder(builds, Path("tiny_cache_ext-key")))
    os.close(os.open(between, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    holding = build._build_folder(builds, Path("tiny_cache_ext-key"))
    held = build._hold_build_lock(holding)
    try:
        assert build.remove_dead_builds(builds) == [dead]
        assert sorted(builds.iterdir()) == sorted([between, build._build_lock_path(holding)])
    finally:
        os.close(held)


@pytest.mark.parametrize("damage", ["truncated", "tampered"])
def test_damaged_entry_is_detected_moved_aside_and_rebuilt(tmp_path, raced, source, damage):
    raced_root, offset, _ = raced
    root = tmp_path / "root"
    shutil.copytree(raced_root / "cache", root / "cache")
    (entry,) = _entries(root)
    module_file = entry / "tiny_cache_ext.so"
    data = bytearray(module_file.read_bytes())
    if damage == "truncated":
        module_file.write_bytes(data[: len(data) // 2])
    else:  # same size, one byte changed
        data[len(data) // 2] ^= 0xFF
        module_file.write_bytes(data)
    assert build.verify_entry(entry, "tiny_cache_ext", entry.name.rsplit("-", 1)[1]) is not None

    result = _finish(_start(root, source, offset))
    assert result["sum"] == 5 + offset
    assert result["file"] == str(module_file)
    assert build.verify_entry(entry, "tiny_cache_ext", entry.name.rsplit("-", 1)[1]) is None
    (moved,) = (root / "bad").iterdir()
    assert moved.name.startswith(entry.name)
    assert "does not match its manifest" in result["stderr"]


def test_read_only_cache_falls_back_to_a_private_build_with_a_warning(source):
    offset = 7000 + uuid.uuid4().int % 1000
    base = Path(tempfile.mkdtemp(prefix="ro-cache-test-"))
    try:
        private_source = base / "tiny.cpp"
        shutil.copyfile(source, private_source)
        root = base / "ro"
        (root / "cache").mkdir(parents=True)
        # root ignores permission bits unless it lacks CAP_DAC_OVERRIDE: drop that capability for the builder.
        prefix = [] if os.geteuid() != 0 else ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                                               "--bounding-set=-dac_override,-dac_read_search"]
        os.chmod(root / "cache", 0o555)
        os.chmod(root, 0o555)
        try:
            result = _finish(_start(root, private_source, offset, prefix=prefix))
        finally:
            os.chmod(root, 0o755)
            os.chmod(root / "cache", 0o755)
        assert result["sum"] == 5 + offset
        assert not result["file"].startswith(str(root))
        assert "is not writable" in result["stderr"] and "RuntimeWarning" in result["stderr"]
        assert not list((root / "cache").iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_different_flags_or_sources_give_different_keys(tmp_path, source):
    base = build.ExtensionSpec(name="tiny_cache_ext", sources=(str(source),), extra_cflags=("-DTINY_OFFSET=1",))
    other_flags = build.ExtensionSpec(name="tiny_cache_ext", sources=(str(source),), extra_cflags=("-DTINY_OFFSET=2",))
    edited = tmp_path / "tiny.cpp"
    edited.write_text(source.read_text() + "\n// edited\n")
    other_source = build.ExtensionSpec(name="tiny_cache_ext", sources=(str(edited),), extra_cflags=("-DTINY_OFFSET=1",))
    other_arch = build.ExtensionSpec(name="tiny_cache_ext", sources=(str(source),), extra_cflags=("-DTINY_OFFSET=1",),
                                     key_extras=(("cutlass", "9.9"),))
    keys = [build.extension_key(s) for s in (base, other_flags, other_source, other_arch)]
    assert len(set(keys)) == 4
    assert build.extension_key(base) == keys[0]  # stable
    # Same content under another path is the same build.
    copy = tmp_path / "copy" / "tiny.cpp"
    copy.parent.mkdir()
    copy.write_text(source.read_text())
    assert build.extension_key(build.ExtensionSpec(name="tiny_cache_ext", sources=(str(copy),),
                                                   extra_cflags=("-DTINY_OFFSET=1",))) == keys[0]


def test_spec_rejects_bad_names_missing_sources_and_bad_archs(source):
    with pytest.raises(ValueError, match="Python identifier"):
        build.ExtensionSpec(name="not-an-identifier", sources=(str(source),))
    with pytest.raises(ValueError, match="does not exist"):
        build.ExtensionSpec(name="x", sources=("/nonexistent/x.cpp",))
    with pytest.raises(ValueError, match="sm_90a"):
        build.ExtensionSpec(name="x", sources=(str(source),), cuda_archs=("90",))


def test_an_unusable_cache_means_one_build_per_process_shared_with_its_self_check_and_no_folder_left(tmp_path,
                                                                                                       source):
    """A cache the process cannot use (here: group-writable) makes it build privately: once for the loader and its
    self-check child together, saying so once, and the private folder is gone when the process exits."""
    offset = 11000 + uuid.uuid4().int % 1000
    root, temp, module_dir = tmp_path / "shared-cache", tmp_path / "tmp", tmp_path / "module"
    for folder in (root, temp, module_dir):
        folder.mkdir()
    root.chmod(0o775)
    (module_dir / "counted_source.py").write_text(COUNTED_SOURCE)
    compiles = tmp_path / "compiles.log"
    env = {**_env(), build.BUILD_DIR_ENV: str(root), "TMPDIR": str(temp), "TINY_COMPILES": str(compiles)}
    done = subprocess.run([sys.executable, "-c", TABLE_LOADER, str(source), str(offset), str(module_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    assert "self-check" in result["error"] and "crashed" in result["error"] and "conv3d" in result["error"], \
        "the self-check child did not run the tiny build"
    assert compiles.read_text().split() == [str(result["pid"])], "compiled more than once, or in the child"
    warnings = [line for line in done.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and f"build cache {root} is not private" in warnings[0], done.stderr[-3000:]
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own, not a build
    assert not left, f"private build folders were left in the temporary folder: {left}"
    assert not list(root.iterdir()), "wrote into a cache others can write"
