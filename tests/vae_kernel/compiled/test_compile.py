"""CI compile check: the real decoder extension compiles and links for sm_90a and sm_100a on a GPU-less machine,
through the same build code and cache a GPU user gets (here into a temporary cache), and the built module imports.

Cost on 2 cores: about 3-5 minutes per architecture (the CUTLASS conv file dominates). Needs nvcc (CUDA 12.8+ for
sm_100a); without a toolkit the test is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel.compiled import build, extension

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine"),
    pytest.mark.timeout(1800),
]

WARM_LOAD = """
import json, sys, time
start = time.monotonic()
from fastvideo_pan2_ext.vae_kernel.compiled import extension
ext = extension.build_extension(sys.argv[1], root=sys.argv[2])
print(json.dumps({"arch": ext.arch(), "file": ext.__file__, "seconds": time.monotonic() - start}))
"""


@pytest.fixture(scope="module")
def cache_root(compile_cache):
    return compile_cache  # conftest: the one cache of the test run (tests/gpu_check/test_gpu_check.py's dry run finds it too)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_extension_compiles_links_and_imports_without_a_gpu(arch, cache_root, monkeypatch):
    monkeypatch.setenv("MAX_JOBS", os.environ.get("MAX_JOBS", "1"))
    start = time.monotonic()
    ext = extension.build_extension(arch, root=cache_root)
    cold = time.monotonic() - start
    print(f"\n{arch}: cold build {cold:.0f} s")
    assert ext.arch() == arch  # for sm_100a: after the sm_90a module was imported into this process
    entry = build.published_entry(extension.extension_spec(arch), cache_root)
    assert ext.__file__ == str(entry / f"{extension.extension_name(arch)}.so")
    # Of this module's own code only the init function is exported, and no process-wide unique symbol: hidden
    # visibility keeps two builds loaded into one process apart.
    exported = subprocess.run(["nm", "-D", "--defined-only", ext.__file__], capture_output=True, text=True).stdout
    symbols = [line.split() for line in exported.splitlines() if len(line.split()) == 3]
    assert [name for _, kind, name in symbols if "wan22" in name] == [f"PyInit_{extension.extension_name(arch)}"]
    assert not [name for _, kind, name in symbols if kind == "u" and not name.startswith("_ZZNSt")]  # std: same data
    manifest = json.loads((entry / build.MANIFEST).read_text())
    assert manifest["inputs"]["cuda_archs"] == [arch]
    assert manifest["inputs"]["key_extras"]["cutlass"] == extension.cutlass_version(extension.cutlass_source_dir())
    # The binding validates before touching CUDA: a CPU tensor is refused with a message, not a crash.
    x = torch.zeros(1, 3, 3, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        ext.conv3d(x, torch.zeros(8, 3, 3, 3, 8, dtype=torch.bfloat16), torch.zeros(8), torch.empty(1, 1, 1, 8, 8,
                   dtype=torch.bfloat16), None, [0, 0, 1], [0, 0, 1])

    # A second process finds the published build: no compiler, same file.
    done = subprocess.run([sys.executable, "-c", WARM_LOAD, arch, str(cache_root)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warm = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{arch}: warm load {warm['seconds']:.1f} s (including importing torch)")
    assert warm["file"] == ext.__file__ and warm["arch"] == arch
    assert "building" not in done.stderr


def test_architectures_get_different_keys_and_unknown_ones_are_refused():
    keys = {extension.extension_spec(a).cuda_archs: build.extension_key(extension.extension_spec(a))
            for a in extension.ARCHS}
    assert len(set(keys.values())) == len(extension.ARCHS) == 3
    with pytest.raises(ValueError, match="sm_90a"):
        extension.extension_spec("sm_80")


def test_every_source_and_header_in_csrc_is_built_and_hashed():
    files = {p.name for p in extension.CSRC.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".cuh")}
    assert files == set(extension.SOURCES) | set(extension.HEADERS)
