"""Shared fixtures. The plain helpers live in `_vae_helpers.py` (import them as `from _vae_helpers import ...`)."""

from __future__ import annotations

import os

# Under pytest-xdist (CI: two workers on two cores) each worker and every process it starts computes on one thread:
# two workers of two threads each would oversubscribe the cores. A comparison that depends on the thread count sets
# its own (`_threads.torch_threads`).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from _vae_helpers import make_wan22_vae
from fastvideo_pan2_ext.attention import ENV_VAR
from fastvideo_pan2_ext.vae_kernel.portable import ops


# The test files that take longest under `.ci/run`, longest first. pytest-xdist hands a worker a whole file at a time
# (`--dist loadfile`; `--no-loadscope-reorder` keeps this order): these go out first so that the run does not end
# on one of them with the other worker idle. The rest follow in collection order.
LONGEST_FIRST = (
    "tests/gpu_check/test_gpu_check.py",
    "tests/model/test_pan2_parallel.py",
    "tests/vae_kernel/test_same_video_real_widths.py",
    "tests/fastvideo_integration/test_fast_decode_ranks.py",
    "tests/vae_kernel/test_encoder_ranks.py",
    "tests/fastvideo_integration/test_interrupts.py",
    "tests/fastvideo_integration/test_e2e_generate.py",
    "tests/fastvideo_integration/test_wan_pipelines.py",
    "tests/fastvideo_integration/serving/test_serve_scale_out.py",
    "tests/vae_kernel/compiled/test_compile.py",
    "tests/fastvideo_integration/serving/test_serve.py",
)


def pytest_collection_modifyitems(config, items):
    gone = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py's LONGEST_FIRST names files that do not exist: {gone}")
    first = {path: place for place, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))  # stable: the rest keep order


@pytest.fixture(autouse=True)
def _fa4_variable_restored():
    """The FA4 policy writes FASTVIDEO_FA4 into os.environ, and every subprocess a later test starts inherits it
    (pytest's monkeypatch.delenv of an unset variable does not undo a later write): each test ends with the value it
    started with."""
    before = os.environ.get(ENV_VAR)
    yield
    if before is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = before


@pytest.fixture(scope="session")
def wan22_vae():
    """A narrow seeded random-weight Wan2.2-layout diffusers `AutoencoderKLWan` (fp32, eval). Do not modify it:
    cast a `copy.deepcopy` of it instead."""
    return make_wan22_vae(seed=0)


@pytest.fixture(scope="session")
def wan22_state_dict(wan22_vae):
    """`wan22_vae`'s whole state dict (encoder included), fp32, as independent tensors."""
    return {name: tensor.detach().clone() for name, tensor in wan22_vae.state_dict().items()}


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """The build cache every test that builds the real CUDA extension uses (test_compile, the binding checks,
    can_implement, the GPU check's rehearsal): one process imports a module name once, so two caches in one test run
    would hand a later test the first one's module. The first test that needs an arch builds it; the rest load it.
    Under pytest-xdist the workers share one cache (beside their own temp folders): the build cache's lock lets one
    worker build while the other waits, rather than both building."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "wan22-compile-cache"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny PAN2 checkpoint, made once per session by `python -m fastvideo_pan2_ext.demo.tiny_checkpoints`
    (see _pan2_helpers)."""
    from _pan2_helpers import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def wan22_stock(tmp_path_factory):
    """A tiny stock Wan2.2-TI2V-5B checkpoint (model_index: WanPipeline; Wan2.2 VAE: residual, patch size 2)."""
    from _pan2_helpers import WAN22, stock_checkpoint

    return stock_checkpoint(tmp_path_factory.getbasetemp(), *WAN22)


@pytest.fixture(scope="session")
def wan21_stock(tmp_path_factory):
    """A tiny stock Wan2.1 T2V 1.3B checkpoint (16 latent channels, the plain Wan2.1 VAE)."""
    from _pan2_helpers import WAN21, stock_checkpoint

    return stock_checkpoint(tmp_path_factory.getbasetemp(), *WAN21)


@pytest.fixture(scope="session")
def pan2(tiny_ckpt):
    """(pipeline, fastvideo_args) for the tiny checkpoint, built in this process the way a FastVideo worker builds
    it (FastVideo's own `build_pipeline`), once per test run (tests that change its config restore it)."""
    import os

    from _pan2_helpers import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.pipelines import build_pipeline

    args = FastVideoArgs.from_kwargs(model_path=str(tiny_ckpt), num_gpus=1)
    pipeline = build_pipeline(args)
    pipeline.post_init()  # what the first forward does: creates the stages
    yield pipeline, args
    from fastvideo.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _cpu_computing_in(monkeypatch, dtype: torch.dtype) -> torch.dtype:
    monkeypatch.setattr(ops, "cpu_has_amx_bf16", lambda: dtype == torch.bfloat16)
    assert ops.compute_dtype(torch.device("cpu")) == dtype
    return dtype


def _skip_without_onednn_bf16() -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 conv (no AVX-512): it only ever computes in fp32")


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32-cpu", "amx-bf16-cpu"])
def cpu_compute(request, monkeypatch) -> torch.dtype:
    """The portable path as it runs on either kind of CPU, whichever this one is: one without AMX-BF16 (computes in
    fp32) and one with it (bf16). The hardware probe is replaced, in this process only. A CPU without AVX-512 has no
    oneDNN bf16 conv at all (torch refuses it): there only the fp32 kind runs."""
    if request.param == torch.bfloat16:
        _skip_without_onednn_bf16()
    return _cpu_computing_in(monkeypatch, request.param)


@pytest.fixture
def amx_bf16_cpu(monkeypatch) -> torch.dtype:
    """The portable path as a CPU with AMX-BF16 runs it (bf16 compute, prepacked conv weights), whichever this one is
    (skipped where torch has no oneDNN bf16 conv): for tests of what only that kind does."""
    _skip_without_onednn_bf16()
    return _cpu_computing_in(monkeypatch, torch.bfloat16)


@pytest.fixture
def fp32_cpu(monkeypatch) -> torch.dtype:
    """The portable path as a CPU without AMX-BF16 runs it (fp32 compute, one rounding per op), whichever this one
    is: for tests of exact math that bf16 compute would blur."""
    return _cpu_computing_in(monkeypatch, torch.float32)
