"""The build cache runs only native code this user built, and loads the bytes it verified (vae_kernel/compiled/build.py,
"Trust"), with real file modes and owners: planted entries are real builds of another variant of a tiny C++
extension, with a manifest that matches them, handed to another uid (65534, "nobody") by `os.chown`; every builder
is a real process. The attacker who swaps a folder between the check and the load is a hook in the builder process
that runs at that moment (the product's own load step, wrapped by the test).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from fastvideo_pan2_ext.vae_kernel.compiled import build

pytestmark = pytest.mark.slow  # real compiles
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root (as in CI)")

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


# The victim of a swap: loads the extension from `root` while an attacker replaces `root` by `planted` (renamed into
# its place, or a link to it) at the last moment the product offers: after the entry was checked, as it is loaded.
SWAPPED = """
import json, os, sys
from fastvideo_pan2_ext.vae_kernel.compiled import build
root, planted, how, source, offset = sys.argv[1:]
load = build._import_module
def swap_then_load(*args, **kwargs):
    os.rename(root, root + ".checked")
    os.rename(planted, root) if how == "renamed" else os.symlink(planted, root)
    return load(*args, **kwargs)
build._import_module = swap_then_load
spec = build.ExtensionSpec(name="tiny_trust_ext", sources=(source,), extra_cflags=(f"-DTINY_OFFSET={offset}",))
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


@pytest.fixture(scope="module")
def own_build(tmp_path_factory, source) -> tuple[Path, int]:
    """A genuine published entry of this user's, and its offset."""
    offset = _offset()
    result = _build(tmp_path_factory.mktemp("own"), source, offset)
    return Path(result["file"]).parent, offset

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


@needs_root
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


@needs_root
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


@needs_root
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
    """Under umask 002 (user-private-group systems) the folders the cache makes, above its root too, and its files
    must still be this user's only, or others could replace them and the cache would refuse its own builds."""
    offset = _offset()
    shared = tmp_path / "shared"  # like /tmp: anyone may write, nobody may rename another's folder
    shared.mkdir()
    shared.chmod(0o1777)
    root = shared / "home" / ".cache" / "root"
    first = _build(root, source, offset, umask=0o002)
    assert first["sum"] == 5 + offset
    entry = Path(first["file"]).parent
    assert entry.parent == root / "cache"
    for folder in (shared / "home", shared / "home" / ".cache", root, root / "cache", root / "build", root / "locks",
                   entry):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for path in entry.iterdir():
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
    second = _build(root, source, offset, umask=0o002)
    assert second["file"] == first["file"] and "building" not in second["stderr"]
    assert not _warnings(second["stderr"])


def _private_root(root: Path) -> Path:
    (root / "cache").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    return root


@pytest.mark.parametrize("how", ["renamed", "symlinked"])
def test_a_root_swapped_between_check_and_load_does_not_change_what_is_loaded(tmp_path, source, own_build,
                                                                              other_build, how):
    """Whoever can write a folder above the cache can swap the root after it was checked: the bytes loaded must be
    the bytes verified. The plant is as good as an attacker could make it: this user's, private, with a manifest
    that matches it for this very key."""
    genuine, offset = own_build
    root, planted = _private_root(tmp_path / "root"), _private_root(tmp_path / "planted")
    shutil.copytree(genuine, root / "cache" / genuine.name)
    _plant(other_build, planted / "cache", _spec(source, offset))

    done = subprocess.run([sys.executable, "-c", SWAPPED, str(root), str(planted), how, str(source), str(offset)],
                          capture_output=True, text=True, env={**os.environ, "MAX_JOBS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (tmp_path / "root.checked").is_dir() and root.resolve() != tmp_path / "root.checked", "no swap happened"
    assert result["sum"] == 5 + offset, f"the swapped-in code ran (the root was {how} between check and load)"
    assert "building" not in done.stderr, "it rebuilt instead of loading the checked build"


def test_a_group_writable_folder_above_the_cache_makes_it_untrusted(tmp_path, source, other_build):
    """A project folder of a shared cluster (setgid, group-writable: 2775) holding a private cache: any member of the
    group can rename the root away and put theirs in its place, so nothing under it is loaded."""
    offset = _offset()
    parent = tmp_path / "project"
    root = _private_root(parent / "root")
    _plant(other_build, root / "cache", _spec(source, offset))  # what a member could have put in its place
    parent.chmod(0o2775)
    before = sorted(p.name for p in root.rglob("*"))

    result = _build(root, source, offset)
    assert result["sum"] == 5 + offset, "code from a cache others can replace ran"
    assert not result["file"].startswith(str(root))
    (warning,) = _warnings(result["stderr"])
    assert f"build cache {root} is not private" in warning
    assert f"{parent}, a folder above the build cache, is group- or world-writable (mode 0o2775)" in warning
    assert sorted(p.name for p in root.rglob("*")) == before, "wrote into a cache others can replace"


@pytest.mark.parametrize("layout,problem", [
    pytest.param("a-folder-of-another-user", "is owned by uid 65534, not by this user", marks=needs_root,
                 id="a-folder-of-another-user"),
    pytest.param("sticky-shared-folder-then-another-users", "is group- or world-writable (mode 0o1777)",
                 marks=needs_root, id="sticky-shared-folder-then-another-users"),
    pytest.param("sticky-shared-folder-then-this-users", None, id="sticky-shared-folder-then-this-users"),
    pytest.param("a-link-to-a-private-folder", None, id="a-link-to-a-private-folder")])
def test_every_folder_above_the_root_decides_whether_it_is_trusted(tmp_path, layout, problem):
    """The rule for the folders above the root (build.check_parent), up to `/`: this user's or root's and writable by
    nobody else, or sticky (like /tmp) with the next folder this user's or root's."""
    top = tmp_path / "top"
    top.mkdir()
    if layout == "a-folder-of-another-user":
        root, blamed = _private_root(top / "root"), top
        os.chown(top, NOBODY, NOBODY)
    elif layout.startswith("sticky-shared-folder"):
        theirs = top / "theirs"
        root, blamed = _private_root(theirs / "root"), top
        top.chmod(0o1777)
        if layout.endswith("another-users"):
            os.chown(theirs, NOBODY, NOBODY)
    else:
        root, blamed = top / "link", top
        os.symlink(_private_root(top / "real"), root)
    if problem is None:
        os.close(build.open_folder(root))
    else:
        with pytest.raises(build.UntrustedCache) as caught:
            build.open_folder(root)
        assert str(caught.value) == f"{blamed}, a folder above the build cache, {problem}" + (
            f" (uid {os.geteuid()}) or root" if "owned" in problem else "")


# A builder as a user without root's power over files (root less CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, as
# setpriv drops them): another user's unreadable file or folder refuses it as it refuses any user. Its "compiler"
# copies a real build of the extension (the cache's logic runs; the compile is the other tests').
STUBBED = """
import json, shutil, sys
from fastvideo_pan2_ext.vae_kernel.compiled import build
root, source, offset, prebuilt = sys.argv[1:]
def copy_prebuilt(spec, build_dir, timeout_s):
    (build_dir / build.BUILD_LOG).write_text("copied, not compiled")
    shutil.copyfile(prebuilt, build_dir / f"{spec.name}.so")
    return build_dir / f"{spec.name}.so"
build._build_in_child = copy_prebuilt
spec = build.ExtensionSpec(name="tiny_trust_ext", sources=(source,), extra_cflags=(f"-DTINY_OFFSET={offset}",))
module = build.load_extension(spec, root=root)
print(json.dumps({"file": module.__file__, "sum": module.add(2, 3)}))
"""
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")


@needs_root
@needs_setpriv
@pytest.mark.parametrize("foreign", ["module", "entry"])
def test_another_users_unreadable_file_or_folder_in_an_entry_gives_a_build_not_a_permission_error(tmp_path, source,
                                                                                                  own_build, foreign):
    prebuilt, built_offset = own_build
    offset = _offset()
    root = _private_root(tmp_path / "root")
    entry = _plant(prebuilt, root / "cache", _spec(source, offset))
    target = entry / f"{NAME}.so" if foreign == "module" else entry
    target.chmod(0o700 if foreign == "entry" else 0o600)
    _chown_tree(target, NOBODY)  # copied in by root, say: nobody else can put it there
    proc = subprocess.Popen(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
                             STUBBED, str(root), str(source), str(offset), str(prebuilt / f"{NAME}.so")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != build.BUILD_DIR_ENV})
    result = _finish(proc, timeout=120)
    assert result["sum"] == 5 + built_offset and "PermissionError" not in result["stderr"]
    if foreign == "module":  # the entry is this user's: moved aside, and built again in its place
        assert result["file"] == str(entry / f"{NAME}.so") and (entry / f"{NAME}.so").stat().st_uid == os.geteuid()
        assert "owned by uid 65534, not by this user" in result["stderr"]
    else:  # another user's folder cannot be moved aside: a private build, one warning saying why
        assert not result["file"].startswith(str(root))
        (warning,) = _warnings(result["stderr"])
        assert f"build cache {root} is not private ({entry} is bad (" in warning and "cannot be moved aside" in warning


def test_a_fifo_in_an_entry_is_refused_without_opening_it(tmp_path, source, own_build):
    prebuilt, _ = own_build
    spec = _spec(source, _offset())
    root = _private_root(tmp_path / "root")
    entry = _plant(prebuilt, root / "cache", spec)
    (entry / build.BUILD_LOG).unlink()
    os.mkfifo(entry / build.BUILD_LOG, 0o600)  # no writer: opening it to read would wait forever
    verdict, key = [], entry.name[len(NAME) + 1:]
    checker = threading.Thread(target=lambda: verdict.append(build.verify_entry(entry, NAME, key)), daemon=True)
    checker.start()
    checker.join(timeout=20)
    assert verdict == [f"{entry / build.BUILD_LOG} is a symbolic link or not a file"]
