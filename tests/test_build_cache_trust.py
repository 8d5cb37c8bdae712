"""The build cache runs only native code this user built (vae_kernel/compiled/build.py, "Trust"), with real file modes and
owners: planted entries are real builds of another variant of a tiny C++ extension, with a manifest that matches
them, handed to another uid (65534, "nobody") by `os.chown`; every builder is a real process.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fastvideo_pan2_ext.vae_kernel.compiled import build

pytestmark = [pytest.mark.slow,  # real compiles
              pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root (as in CI)")]

NOBODY = 65534
NAME = "tiny_trust_ext"
SOURCE = """
#include <pybind11/pybind11.h>
static int add(int a, int b) { return a + b + TINY_OFFSET; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

# One builder process: argv root ("-": $WAN22_VAE_DECODE_BUILD_DIR's), source, offset, umask; prints what it loaded.
BUILDER = """
import json, os, sys
os.umask(int(sys.argv[4], 8))
from fastvideo_pan2_ext.vae_kernel.compiled import build
root = None if sys.argv[1] == "-" else sys.argv[1]
spec = build.ExtensionSpec(name="tiny_trust_ext", sources=(sys.argv[2],), extra_cflags=(f"-DTINY_OFFSET={sys.argv[3]}",))
module = build.load_extension(spec, root=root)
print(json.dumps({"file": module.__file__, "sum": module.add(2, 3)}))
"""


def _spec(source: Path, offset: int) -> build.ExtensionSpec:
    return build.ExtensionSpec(name=NAME, sources=(str(source),), extra_cflags=(f"-DTINY_OFFSET={offset}",))


def _start(root: Path | None, source: Path, offset: int, umask: int = 0o022, env: dict | None = None):
    env = {**os.environ, "MAX_JOBS": "1", **(env or {})}
    if root is not None:
        env.pop(build.BUILD_DIR_ENV, None)
    argv = [sys.executable, "-c", BUILDER, "-" if root is None else str(root), str(source), str(offset), oct(umask)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"builder failed (exit {proc.returncode}):\n{err[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    return result


def _build(root: Path | None, source: Path, offset: int, **kwargs) -> dict:
    return _finish(_start(root, source, offset, **kwargs))


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for below in path.rglob("*"):
        os.chown(below, uid, uid, follow_symlinks=False)


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "RuntimeWarning" in line]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny.cpp"
    path.write_text(SOURCE)
    return path


@pytest.fixture(scope="module")
def other_build(tmp_path_factory, source) -> Path:
    """A genuine published entry of the extension with another offset (different code), to plant."""
    root = tmp_path_factory.mktemp("other")
    offset = 9000 + uuid.uuid4().int % 1000
    result = _build(root, source, offset)
    assert result["sum"] == 5 + offset
    return Path(result["file"]).parent


def _plant(other_build: Path, cache: Path, spec: build.ExtensionSpec) -> Path:
    """`other_build`'s code as the entry of `spec`, with a manifest that matches it (only the key rewritten)."""
    key = build.extension_key(spec)
    entry = cache / f"{spec.name}-{key}"
    shutil.copytree(other_build, entry)
    manifest = json.loads((entry / build.MANIFEST).read_text())
    manifest["key"] = key
    (entry / build.MANIFEST).write_text(json.dumps(manifest))
    assert build.verify_entry(entry, spec.name, key) is None, "the plant must pass every check but the owner's"
    return entry


def _offset() -> int:
    return 1000 + uuid.uuid4().int % 8000


def test_a_planted_entry_owned_by_another_user_is_not_loaded_but_moved_aside_and_rebuilt(tmp_path, source,
                                                                                           other_build):
    offset = _offset()
    root = tmp_path / "root"
    (root / "cache").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    entry = _plant(other_build, root / "cache", _spec(source, offset))
    _chown_tree(entry, NOBODY)
    assert "owned by uid 65534" in build.verify_entry(entry, NAME, entry.name.rsplit("-", 1)[1])

    result = _build(root, source, offset)
    assert result["sum"] == 5 + offset, "the planted code ran"
    assert result["file"] == str(entry / f"{NAME}.so") and (entry / f"{NAME}.so").stat().st_uid == os.geteuid()
    (moved,) = (root / "bad").iterdir()
    assert moved.stat().st_uid == NOBODY
    assert "owned by uid 65534, not by this user" in result["stderr"]


@pytest.mark.parametrize("where,mode", [("cache", 0o775), ("root", 0o757)], ids=["group-writable-cache",
                                                                                 "world-writable-root"])
def test_a_cache_folder_others_can_write_is_not_trusted(tmp_path, source, other_build, where, mode):
    offset = _offset()
    root = tmp_path / "root"
    (root / "cache").mkdir(parents=True)
    entry = _plant(other_build, root / "cache", _spec(source, offset))  # this user's files, in a folder others write
    (root if where == "root" else root / "cache").chmod(mode)
    before = sorted(p.name for p in root.rglob("*"))

    result = _build(root, source, offset)
    try:
        assert result["sum"] == 5 + offset, "the planted code ran"
        assert not result["file"].startswith(str(root)), "built into a cache others can write"
        (warning,) = _warnings(result["stderr"])
        assert "is not private" in warning and f"mode {oct(mode)}" in warning and "group- or world-writable" in warning
        assert sorted(p.name for p in root.rglob("*")) == before, "wrote into a cache others can write"
        assert (entry / f"{NAME}.so").exists()
    finally:
        shutil.rmtree(Path(result["file"]).parent, ignore_errors=True)


def test_a_shared_build_dir_from_the_environment_is_not_used(tmp_path, source, other_build):
    """$WAN22_VAE_DECODE_BUILD_DIR at a cluster's shared scratch folder (another user's, 1777) holding that user's
    entry for the very key this process wants."""
    offset = _offset()
    shared = tmp_path / "scratch"
    (shared / "cache").mkdir(parents=True)
    _plant(other_build, shared / "cache", _spec(source, offset))
    _chown_tree(shared, NOBODY)
    shared.chmod(0o1777)
    before = sorted(p.name for p in shared.rglob("*"))

    result = _build(None, source, offset, env={build.BUILD_DIR_ENV: str(shared)})
    try:
        assert result["sum"] == 5 + offset, "the other user's code ran"
        assert not result["file"].startswith(str(shared))
        (warning,) = _warnings(result["stderr"])
        assert f"build cache {shared} is not private" in warning and "owned by uid 65534" in warning
        assert sorted(p.name for p in shared.rglob("*")) == before
    finally:
        shutil.rmtree(Path(result["file"]).parent, ignore_errors=True)


def test_a_lock_held_by_another_user_does_not_stall_the_build(tmp_path, source):
    offset = _offset()
    spec = _spec(source, offset)
    root = tmp_path / "root"
    (root / "locks").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    lock = root / "locks" / f"{NAME}-{build.extension_key(spec)}.lock"
    lock.touch(mode=0o644)
    os.chown(lock, NOBODY, NOBODY)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(lock) as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        start = time.monotonic()
        result = _finish(_start(root, source, offset), timeout=240)  # the lock's own timeout is 30 minutes
        assert result["sum"] == 5 + offset
        assert Path(result["file"]).parent.parent == root / "cache"
        assert "not waiting on the build lock" in result["stderr"] and "owned by uid 65534" in result["stderr"]
        assert time.monotonic() - start < 240
    finally:
        holder.kill()
        holder.wait()


def test_a_fresh_cache_is_private_whatever_the_umask_and_its_builds_are_reused(tmp_path, source):
    """Under umask 002 (user-private-group systems) the cache's folders and files must still be this user's only,
    or the cache would refuse its own builds."""
    offset = _offset()
    root = tmp_path / "fresh" / "root"
    first = _build(root, source, offset, umask=0o002)
    assert first["sum"] == 5 + offset
    entry = Path(first["file"]).parent
    assert entry.parent == root / "cache"
    for folder in (root, root / "cache", root / "build", root / "locks", entry):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for path in entry.iterdir():
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
    second = _build(root, source, offset, umask=0o002)
    assert second["file"] == first["file"] and "building" not in second["stderr"]
    assert not _warnings(second["stderr"])
