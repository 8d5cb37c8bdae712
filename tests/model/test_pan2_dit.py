"""PAN2's DiT in FastVideo (`fastvideo_pan2_ext.model`): the real configuration's size and weight names, the loader's
view of a checkpoint (FastVideo's own `TransformerLoader`, on a tiny random checkpoint with IFM's fp32/bf16 layout),
the numbers against the plain-torch reference (`fastvideo_pan2_ext.reference.pan2_transformer`) in fp32 and bf16,
sequence parallelism over two gloo ranks against one rank, and the attention's route to FA4.

Everything runs in FastVideo's CPU setup (its distributed environment in this process, gloo, torch SDPA), but the FA4
route, which runs in fresh processes on a faked datacenter Blackwell GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from _pan2_helpers import free_port, recording_fa4
from _ranks import run_ranks

from fastvideo_pan2_ext.model.architecture import (PAN2TransformerConfig, parameter_count, stored_in_fp32,
                                                   weight_shapes)

TINY = PAN2TransformerConfig(num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6), num_layers=2,
                             num_refiner_layers=1, text_embed_dim=24)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Latents [B, 97, T', h, w]: h=4, w=6 is a 2 x 3 patch grid (odd width), T'=3; L=5 text tokens.
LATENT_SHAPE = (1, TINY.in_channels, 3, 4, 6)
TEXT_TOKENS = 5


def _fastvideo_ready() -> None:
    """FastVideo able to run on this GPU-less machine and PAN2's DiT in its registry (what the plugin's register()
    does; only the two pieces this needs, so these tests do not depend on the rest of the registration)."""
    import fastvideo  # noqa: F401 - FastVideo first, as a user's process imports it

    from fastvideo_pan2_ext.fastvideo_integration import compat
    from fastvideo_pan2_ext.model.registry import register_models

    compat.cpu_gaps.close_cpu_gaps()
    register_models()


def _dit_class():
    from fastvideo.models.registry import ModelRegistry

    _fastvideo_ready()
    cls, arch = ModelRegistry.resolve_model_cls("PAN2Transformer3DModel")
    assert arch == "PAN2Transformer3DModel"
    return cls


def _mapped(config: PAN2TransformerConfig) -> dict[str, list[tuple[str, int | None, int | None]]]:
    """The model's parameter name -> the checkpoint names (with merge index, count) FastVideo's loader puts there."""
    from fastvideo.models.loader.utils import get_param_names_mapping

    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    mapping = get_param_names_mapping(PAN2DiTConfig().param_names_mapping)
    targets: dict[str, list] = {}
    for name in weight_shapes(config):
        target, index, count = mapping(name)
        targets.setdefault(target, []).append((name, index, count))
    return targets


def _slice(tensor: torch.Tensor, index: int | None, count: int | None) -> torch.Tensor:
    return tensor if index is None else tensor.chunk(count, dim=0)[index]


# --------------------------------------------------------------------------------------------------- configuration


def test_the_config_takes_a_checkpoints_config_json():
    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    real = PAN2DiTConfig()
    assert real.transformer_config() == PAN2TransformerConfig()
    assert (real.hidden_size, real.num_attention_heads, real.num_channels_latents, real.in_channels,
            real.out_channels) == (4096, 32, 48, 97, 48)
    assert real.arch_config.cast_prompt_embeds_to_dit_dtype
    assert "TORCH_SDPA" in {b.name for b in real._supported_attention_backends}

    config = PAN2DiTConfig()
    hf = json.loads(json.dumps(TINY.to_json()))  # lists, as config.json holds them
    hf.pop("_class_name")
    config.update_model_arch(hf)  # what TransformerLoader does with transformer/config.json
    assert config.transformer_config() == TINY
    assert (config.hidden_size, config.num_channels_latents, config.patch_size) == (32, 48, (1, 2, 2))
    assert pickle.loads(pickle.dumps(config)).transformer_config() == TINY  # FastVideo sends it to its workers


def test_the_real_model_builds_from_fastvideos_registry_with_every_checkpoint_weight():
    """29.2 B parameters on the meta device; each model parameter is filled by the checkpoint tensors the name mapping
    sends to it (q/k/v concatenated), with the same number of elements; nothing left over either way."""
    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    config = PAN2DiTConfig()
    with torch.device("meta"):
        model = _dit_class()(config=config, hf_config={})
    real = config.transformer_config()
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    assert 29.0e9 <= total <= 29.4e9 and total == parameter_count(real)

    shapes = weight_shapes(real)
    targets = _mapped(real)
    assert set(targets) == set(params), (set(targets) ^ set(params))
    for target, sources in targets.items():
        counts = {count for _, _, count in sources}
        assert counts == {None} and len(sources) == 1 or counts == {len(sources)}, (target, sources)
        assert sum(math.prod(shapes[name]) for name, _, _ in sources) == params[target].numel(), target
        for name, index, count in sources:
            assert tuple(_slice(params[target], index, count).shape) == shapes[name], (target, name)


def test_the_joint_blocks_are_the_first_module_list():
    """FastVideo's layerwise offload hooks only the model's first nn.ModuleList child: it must be the 44 joint
    blocks (not the 4 refiner blocks)."""
    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    with torch.device("meta"):
        model = _dit_class()(config=PAN2DiTConfig(), hf_config={})
    lists = [(name, len(child)) for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)]
    assert lists == [("transformer_blocks", 44), ("context_refiner", 4)]


def test_registration_is_idempotent():
    from fastvideo.models.registry import ModelRegistry

    from fastvideo_pan2_ext.model.registry import register_models

    _fastvideo_ready()
    entry = ModelRegistry.models["PAN2Transformer3DModel"]
    register_models()
    assert ModelRegistry.models["PAN2Transformer3DModel"] is entry


# --------------------------------------------------------------------------------------------------- a checkpoint


def write_tiny_checkpoint(root: Path, config: PAN2TransformerConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """`root/transformer/{config.json, diffusion_pytorch_model.safetensors}` with random weights in IFM's layout
    (the joint blocks' norm1.linear in fp32, the rest bf16); returns the state dict as written."""
    from safetensors.torch import save_file

    folder = root / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name, shape in weight_shapes(config).items():
        value = torch.randn(shape, generator=generator)
        if len(shape) > 1:
            value = value / math.sqrt(math.prod(shape[1:]))  # unit-variance activations
        elif "norm" in name:
            value = 1 + 0.2 * value
        else:
            value = 0.3 * value  # biases, the text modulation table, context_type_embedding
        state_dict[name] = value.to(torch.float32 if stored_in_fp32(name) else torch.bfloat16).contiguous()
    save_file(state_dict, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_json()))
    return state_dict


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("pan2-dit")
    return root, write_tiny_checkpoint(root)


def _load(root: Path, precision: str, sp_size: int = 1):
    """The DiT as FastVideo's pipeline loads it: TransformerLoader with a PAN2 DiT config and `precision`."""
    from fastvideo.configs.pipelines.base import PipelineConfig
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.models.loader.component_loader import TransformerLoader

    from fastvideo_pan2_ext.model.dit_config import PAN2DiTConfig

    _fastvideo_ready()
    args = FastVideoArgs(model_path=str(root), num_gpus=sp_size, sp_size=sp_size,
                         pipeline_config=PipelineConfig(dit_config=PAN2DiTConfig(), dit_precision=precision))
    return TransformerLoader().load(str(root / "transformer"), args)


@pytest.fixture(scope="module")
def fastvideo_distributed():
    """FastVideo's distributed environment in this process (one gloo rank), as a worker sets it up; left as found."""
    from fastvideo.distributed.parallel_state import (cleanup_dist_env_and_memory,
                                                      maybe_init_distributed_environment_and_model_parallel,
                                                      model_parallel_is_initialized)

    _fastvideo_ready()
    if model_parallel_is_initialized():  # another test's pipeline set it up: use it, leave it
        yield
        return
    maybe_init_distributed_environment_and_model_parallel(1, 1, f"tcp://127.0.0.1:{free_port()}")
    yield
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def loaded(checkpoint, fastvideo_distributed):
    root, _ = checkpoint
    return {precision: _load(root, precision) for precision in DTYPES}


@pytest.mark.parametrize("precision", DTYPES)
def test_the_loader_puts_every_checkpoint_tensor_in_place(precision, loaded, checkpoint):
    _, state_dict = checkpoint
    model, dtype = loaded[precision], DTYPES[precision]
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {dtype}
    targets = _mapped(TINY)
    assert set(targets) == set(params)
    for target, sources in targets.items():
        for name, index, count in sources:
            assert torch.equal(_slice(params[target], index, count), state_dict[name].to(dtype)), (target, name)


# --------------------------------------------------------------------------------------------------- numbers


def _inputs(seed: int = 1, latent_shape=LATENT_SHAPE, timestep=(734.5, )):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(latent_shape, generator=generator)
    encoder_hidden_states = torch.randn(latent_shape[0], TEXT_TOKENS, TINY.text_embed_dim, generator=generator)
    return hidden_states, torch.tensor(timestep, dtype=torch.float32), encoder_hidden_states


def _run(model, hidden_states, timestep, encoder_hidden_states) -> torch.Tensor:
    """One DiT call as FastVideo's denoising stage makes it (in a forward context; the text as a one-element list)."""
    from fastvideo.forward_context import set_forward_context

    dtype = next(model.parameters()).dtype
    with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
        return model(hidden_states.to(dtype), [encoder_hidden_states.to(dtype)], timestep)


def _reference(hidden_states, timestep, encoder_hidden_states, state_dict, dtype) -> torch.Tensor:
    from fastvideo_pan2_ext.reference import pan2_transformer

    return pan2_transformer(hidden_states.to(dtype), timestep, encoder_hidden_states.to(dtype),
                            {name: value.to(dtype) for name, value in state_dict.items()}, TINY)


def test_fp32_matches_the_reference(loaded, checkpoint):
    _, state_dict = checkpoint
    hidden_states, timestep, text = _inputs()
    out = _run(loaded["fp32"], hidden_states, timestep, text)
    assert out.shape == (1, TINY.out_channels, 3, 4, 6) and out.dtype == torch.float32
    reference = _reference(hidden_states, timestep, text, state_dict, torch.float32)
    assert reference.abs().max() > 1  # a real signal, not a vanishing one
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_bf16_matches_the_reference_within_bf16s_own_error(loaded, checkpoint):
    """bf16 rounds differently wherever two implementations order their casts differently, so the allowance is
    bf16's own: the DiT's bf16 output is within 2% of the output's range of the reference's bf16 output, and no
    further from the fp32 result than 1.25 x the reference's bf16 output is (+ 0.5% of the range)."""
    _, state_dict = checkpoint
    hidden_states, timestep, text = _inputs()
    out = _run(loaded["bf16"], hidden_states, timestep, text).float()
    reference = _reference(hidden_states, timestep, text, state_dict, torch.bfloat16).float()
    exact = _reference(hidden_states, timestep, text, state_dict, torch.float32)
    span = exact.abs().max().item()
    assert (out - reference).abs().max().item() <= 0.02 * span
    assert (out - exact).abs().max().item() <= 1.25 * (reference - exact).abs().max().item() + 0.005 * span


def test_a_batch_is_its_samples(loaded):
    """Two samples (their own timesteps) in one call give each sample's own output: the per-sample modulation."""
    model = loaded["fp32"]
    hidden_states, timestep, text = _inputs(seed=2, latent_shape=(2, *LATENT_SHAPE[1:]), timestep=(999.0, 120.25))
    batched = _run(model, hidden_states, timestep, text)
    for i in range(2):
        alone = _run(model, hidden_states[i:i + 1], timestep[i:i + 1], text[i:i + 1])
        torch.testing.assert_close(batched[i:i + 1], alone, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------- ranks

# 3 frames of 1 x 3 patches: 9 video tokens, so two ranks pad to 10.
SP_LATENT_SHAPE = (1, TINY.in_channels, 3, 2, 6)


def _sp_rank(rank: int, world: int, tmp: str, port: int, root: str) -> torch.Tensor:
    """One FastVideo worker of a sequence-parallel group (its own distributed environment, as its worker entry
    point sets it up): the DiT loaded by TransformerLoader, one call."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world))
    _fastvideo_ready()
    from fastvideo.distributed.parallel_state import maybe_init_distributed_environment_and_model_parallel

    maybe_init_distributed_environment_and_model_parallel(1, world, f"tcp://127.0.0.1:{port}")
    model = _load(Path(root), "fp32", sp_size=world)
    return _run(model, *_inputs(seed=3, latent_shape=SP_LATENT_SHAPE))


@pytest.mark.slow
def test_two_sequence_parallel_ranks_give_one_ranks_output(loaded, checkpoint, tmp_path):
    root, _ = checkpoint
    alone = _run(loaded["fp32"], *_inputs(seed=3, latent_shape=SP_LATENT_SHAPE))
    outputs = run_ranks(_sp_rank, 2, tmp_path, free_port(), str(root), group=False)
    for output in outputs:  # every rank returns the whole output
        torch.testing.assert_close(output, alone, rtol=1e-5, atol=1e-5)


def test_every_attention_goes_through_fastvideos_chosen_backend(loaded, monkeypatch):
    """FastVideo's backend choice is where FA4 acts (FASTVIDEO_FA4, docs/design/pan2.md, "The transformer"): each joint
    block's and each refiner block's attention must be a call of the backend FastVideo chose (here its SDPA backend,
    the one a CPU gets), never torch's attention called directly. Recorded at the backend's forward and at torch's."""
    import torch.nn.functional as F
    from fastvideo.attention.backends.sdpa import SDPAImpl

    model = loaded["fp32"]
    backend_calls, direct_calls = [], []
    through = SDPAImpl.forward

    def recording_backend(self, query, key, value, *args, **kwargs):
        backend_calls.append(query.shape[1])  # the tokens attended over
        return through(self, query, key, value, *args, **kwargs)

    sdpa = F.scaled_dot_product_attention
    inside_backend = []

    def recording_torch(*args, **kwargs):
        if not inside_backend:
            direct_calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    def backend(self, *args, **kwargs):
        inside_backend.append(1)
        try:
            return recording_backend(self, *args, **kwargs)
        finally:
            inside_backend.pop()

    monkeypatch.setattr(SDPAImpl, "forward", backend)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_torch)
    hidden_states, timestep, text = _inputs()
    _run(model, hidden_states, timestep, text)
    video_tokens = 3 * 2 * 3
    assert sorted(backend_calls) == sorted([TEXT_TOKENS] * TINY.num_refiner_layers
                                           + [video_tokens + TEXT_TOKENS] * TINY.num_layers)
    assert direct_calls == []


# --------------------------------------------------------------------------------------------------- FA4

# FastVideo's flash-attention backend takes head sizes from 32 (TINY's 16 gets SDPA on any GPU).
FA4_TINY = dataclasses.replace(TINY, attention_head_dim=32, rope_axes_dim=(8, 12, 12))


def _as_on_a_gpu(mp: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    """FastVideo's attention choice as a CUDA GPU of `capability` makes it (this machine has none): the CPU platform
    answers with the CUDA platform's selection, run while torch reports such a GPU."""
    from fastvideo.platforms.cpu import CpuPlatform
    from fastvideo.platforms.cuda import NonNvmlCudaPlatform  # the CUDA platform that asks torch for the capability

    def on_the_gpu(cls, selected_backend, head_size, dtype):
        with pytest.MonkeyPatch.context() as gpu:
            gpu.setattr(torch.cuda, "is_available", lambda: True)
            gpu.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
            return NonNvmlCudaPlatform.get_attn_backend_cls(selected_backend, head_size, dtype)

    mp.setattr(CpuPlatform, "get_attn_backend_cls", classmethod(on_the_gpu))


def _fa4_on_cpu_tensors(mp: pytest.MonkeyPatch) -> None:
    """What FastVideo's FA4 wrapper needs of the GPU: its FA2 fallback probe reads the tensors' CUDA device (sm_100
    answers "FA4"), and its op has a CUDA kernel only (its own body registered for CPU tensors too)."""
    import fastvideo.attention.utils.flash_attn_cute as cute

    mp.setattr(cute, "_use_fa2", lambda q, k, v: False)
    cute._flash_attn_cute_forward.register_kernel("cpu")(cute._flash_attn_cute_forward._init_fn)


def _fa4_process(rank: int, world: int, tmp: str, port: int, root: str, fa4: str, fastvideo_fa4: str | None,
                 capability: tuple[int, int]) -> dict:
    """A fresh process (FastVideo reads FASTVIDEO_FA4 when its attention modules first import) on a GPU of
    `capability`, FA4 installed (the recording stand-in in `fa4`): PAN2's FA4 policy, the bf16 DiT loaded by
    FastVideo's loader (each attention layer asks FastVideo's backend selection), one call."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(fa4)
        if fastvideo_fa4 is None:
            mp.delenv("FASTVIDEO_FA4", raising=False)
        else:
            mp.setenv("FASTVIDEO_FA4", fastvideo_fa4)
        _fastvideo_ready()
        from fastvideo.distributed.parallel_state import maybe_init_distributed_environment_and_model_parallel

        from fastvideo_pan2_ext.attention import apply_fa4_policy
        from fastvideo_pan2_ext.attention import fa4 as policy

        mp.setattr(policy, "_current_capability", lambda: capability)
        applied = apply_fa4_policy()
        _as_on_a_gpu(mp, capability)
        maybe_init_distributed_environment_and_model_parallel(1, 1, f"tcp://127.0.0.1:{port}")
        model = _load(Path(root), "bf16")
        backends = [layer.backend.name for layer in model.modules() if hasattr(layer, "attn_impl")]
        if "fastvideo.attention.utils.flash_attn_cute" in sys.modules:
            _fa4_on_cpu_tensors(mp)
        out = _run(model, *_inputs())
        from flash_attn.cute.interface import calls

        return {"applied": applied, "backends": backends, "calls": calls, "out": out}


@pytest.mark.slow
def test_fa4_runs_every_attention_on_datacenter_blackwell_through_fastvideos_choice(tmp_path):
    """On sm_100 with FA4 importable and FASTVIDEO_FA4 unset, PAN2's policy turns FA4 on and every joint and refiner
    attention is a call of FA4 through FastVideo's flash-attention backend (none bypasses FastVideo's choice, which
    would leave FA4 uncalled); with FASTVIDEO_FA4=0, or on Hopper, FastVideo's own choice stands (SDPA: no FA2 or FA3
    here) and FA4 is never called. FA4's stand-in computes SDPA, so the outputs are the same bf16 numbers.

    Faked, for the GPU this machine lacks: the capability, CUDA's presence during the backend choice, and the two
    CUDA-only details of FastVideo's FA4 wrapper (`_fa4_on_cpu_tensors`)."""
    root = tmp_path / "checkpoint"
    write_tiny_checkpoint(root, FA4_TINY)
    fa4 = str(recording_fa4(tmp_path / "fa4"))
    attentions = FA4_TINY.num_layers + FA4_TINY.num_refiner_layers

    def run(name, fastvideo_fa4, capability):
        (tmp_path / name).mkdir()
        return run_ranks(_fa4_process, 1, tmp_path / name, free_port(), str(root), fa4, fastvideo_fa4, capability,
                         group=False)[0]

    on = run("sm100", None, (10, 0))
    assert on["applied"] and on["backends"] == ["FLASH_ATTN"] * attentions
    heads, head_dim, video_tokens = FA4_TINY.num_attention_heads, FA4_TINY.attention_head_dim, 3 * 2 * 3
    assert sorted(on["calls"]) == sorted([[1, TEXT_TOKENS, heads, head_dim]] * FA4_TINY.num_refiner_layers
                                         + [[1, video_tokens + TEXT_TOKENS, heads, head_dim]] * FA4_TINY.num_layers)
    for name, fastvideo_fa4, capability in [("fa4-0", "0", (10, 0)), ("sm90", None, (9, 0))]:
        off = run(name, fastvideo_fa4, capability)
        assert not off["applied"] and off["calls"] == [], name
        assert off["backends"] == ["TORCH_SDPA"] * attentions, name
        torch.testing.assert_close(on["out"], off["out"], rtol=0, atol=0)  # the same SDPA on the same bf16 q/k/v
