"""The fast decoder after the denoise, as serving and training code handle a model: decoding under
`torch.inference_mode()` (diffusers' pipelines and FastVideo's decoding stage, on both kinds of CPU), on a VAE whose
weights were made under it, and copying a VAE with the fast decoder on (`copy.deepcopy`, `torch.save`/`torch.load`):
a copy keeps the fast decoder with its options and decodes its own weights, on one rank once pickled
(docs/diffusers.md, "Inference mode, copies and saved VAEs"). The `save_pretrained` round trip, which gives diffusers'
own VAE: tests/diffusers_integration/test_diffusers_decode.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from _diffusers_pipelines import call_kwargs, tiny_pipeline, tiny_vae
from _pan2_helpers import forward_batch
from _ranks import run_ranks

from fastvideo_pan2_ext import enable_fast_decode
from fastvideo_pan2_ext.diffusers_integration.fast_decode import is_fast_decode_enabled
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import ops, weights

LAYOUT = "wan2.2-ti2v"


def _latents(vae, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, vae.config.z_dim, 2, 2, 2, generator=torch.Generator().manual_seed(seed))


def _state(vae):
    return vae.__dict__["_pan2_fast_decode"]


def _fast(vae, z) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z).sample


def _pickled(vae):
    buffer = io.BytesIO()
    torch.save(vae, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ------------------------------------------------------------------------------------------------ inference mode


@pytest.mark.parametrize("conv_algorithm", ["direct", "winograd"])
def test_a_pipeline_under_inference_mode_decodes_as_under_no_grad(cpu_compute, conv_algorithm):
    """The decoder is built during the first call, under inference_mode; the same decoder then serves a call outside
    it, and both give the video a decoder built under no_grad gives."""
    pipe = tiny_pipeline(LAYOUT)
    pipe.set_progress_bar_config(disable=True)
    enable_fast_decode(pipe, conv_algorithm=conv_algorithm)
    with torch.inference_mode():
        served = pipe(**call_kwargs(LAYOUT)).frames
    with torch.no_grad():
        again = pipe(**call_kwargs(LAYOUT)).frames
        enable_fast_decode(pipe, conv_algorithm=conv_algorithm)  # a new decoder, built here
        expected = pipe(**call_kwargs(LAYOUT)).frames
    assert torch.equal(served, expected) and torch.equal(again, expected)


@pytest.mark.slow
def test_fastvideo_decoding_stage_under_inference_mode(pan2, tiny_ckpt, cpu_compute, monkeypatch):
    """FastVideo's decoding stage with the fast decoder on, run under inference_mode (the decoder built there), gives
    the video it gives without."""
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode

    pipeline, args = pan2
    stage = pipeline._stage_name_mapping["decoding_stage"]
    latents = torch.randn(1, 48, 2, 3, 2, generator=torch.Generator().manual_seed(3))

    def decode() -> torch.Tensor:
        monkeypatch.setattr(fast_decode, "_decoders", fast_decode.Workers())  # built in this mode
        batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        batch.latents = latents.clone()
        return stage(batch, args).output

    monkeypatch.setattr(args.pipeline_config, "vae_decode_kernel", True)
    with torch.inference_mode():
        served = decode()
    assert torch.equal(served, decode())


def test_a_vae_made_under_inference_mode_decodes(cpu_compute):
    """A bf16 VAE created under inference_mode: its parameters are inference tensors, and some prepared weights are
    those tensors themselves (the 1x1 convs'). A decoder of it, built under inference_mode too, prepacks its convs as
    any decoder does on a CPU computing in bf16, and decodes as a decoder of the same weights made outside."""
    with torch.inference_mode():
        made_inside = tiny_vae(LAYOUT).to(torch.bfloat16)
        decoder = WanVAEDecoder(made_inside, device="cpu", local=True)
    made_outside = tiny_vae(LAYOUT).to(torch.bfloat16)
    z = _latents(made_outside)
    with torch.no_grad():
        video = decoder.decode(z)
        expected = WanVAEDecoder(made_outside, device="cpu", local=True).decode(z)
    assert torch.equal(video, expected)
    convs = [w for name, w in decoder.weights.items() if w.dim() >= 5 and name != "post_quant_conv.weight"]
    assert all(ops.prepacked(w) == (cpu_compute == torch.bfloat16) for w in convs)


def test_prepack_leaves_an_inference_tensor_unpacked(cpu_compute):
    """An inference tensor has no version counter to tell a prepacked copy stale: prepack leaves it, and the conv
    computes from it as from the same weight unpacked."""
    prepared = weights.prepare("decoder.conv_in.weight", torch.randn(16, 8, 3, 3, 3))
    with torch.inference_mode():
        w = prepared.clone()
        ops.prepack(w)
    assert not ops.prepacked(w)
    x = torch.randn(1, 3, 4, 5, 8).to(torch.bfloat16)
    b = torch.randn(16)
    out, expected = (torch.empty(1, 1, 2, 5, 16, dtype=torch.bfloat16) for _ in range(2))
    ops.conv3d(x, w, b, out)
    ops.conv3d(x, prepared.clone(), b, expected)
    assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------------------ copies


def test_a_deepcopy_keeps_the_fast_decoder_and_decodes_its_own_weights():
    vae = tiny_vae(LAYOUT)
    enable_fast_decode(vae, tile_rows=1)
    z = _latents(vae)
    video = _fast(vae, z)
    twin = copy.deepcopy(vae)
    assert is_fast_decode_enabled(twin) and _state(twin).options == _state(vae).options
    assert torch.equal(_fast(twin, z), video)
    assert _state(twin).worker is not _state(vae).worker and _state(twin).worker.last_plan.tile_rows == 1
    with torch.no_grad():
        twin.decoder.conv_out.bias.add_(0.25)
    assert not torch.equal(_fast(twin, z), video)
    assert torch.equal(_fast(vae, z), video)


@pytest.mark.parametrize("decoded_first", [False, True], ids=["before-a-decode", "after-a-decode"])
def test_torch_save_and_load_keep_the_fast_decoder_with_its_options(decoded_first):
    vae = tiny_vae(LAYOUT)
    enable_fast_decode(vae, tile_rows=1, frames_per_pass=2)
    vae.enable_slicing()
    z = torch.cat([_latents(vae, 0), _latents(vae, 1)])
    video = _fast(vae, z) if decoded_first else None
    loaded = _pickled(vae)
    assert is_fast_decode_enabled(loaded) and _state(loaded).options == _state(vae).options
    if video is None:
        video = _fast(vae, z)
    assert torch.equal(_fast(loaded, z), video)
    plan = _state(loaded).worker.last_plan  # the loaded VAE's own decoder ran, sliced, with the options
    assert (plan.tile_rows, plan.frames_per_pass) == (1, 2)
    assert _state(loaded).worker is not _state(vae).worker


def test_a_given_op_table_is_shared_by_a_deepcopy_and_named_when_pickled():
    vae = tiny_vae(LAYOUT)
    enable_fast_decode(vae, backend=ops.TORCH_OPS)
    z = _latents(vae)
    video = _fast(vae, z)
    twin = copy.deepcopy(vae)
    assert _state(twin).options.backend is ops.TORCH_OPS and torch.equal(_fast(twin, z), video)
    with pytest.raises(TypeError, match="cannot pickle a VAE whose fast decoder runs a given op table .*'torch'"):
        torch.save(vae, io.BytesIO())


def _rank_copies(rank: int, world: int, tmp: str) -> dict:
    vae = tiny_vae(LAYOUT)
    enable_fast_decode(vae, pg=dist.group.WORLD)
    z = _latents(vae)
    video = _fast(vae, z)
    twin, loaded = copy.deepcopy(vae), _pickled(vae)
    return {"twin": torch.equal(_fast(twin, z), video), "twin_split": _state(twin).worker.pg is not None,
            "loaded": torch.equal(_fast(loaded, z), video), "loaded_split": _state(loaded).worker.pg is not None}


@pytest.mark.slow
def test_a_copy_keeps_the_process_group_and_a_pickled_vae_decodes_on_one_rank(tmp_path):
    results = run_ranks(_rank_copies, 2, tmp_path)
    assert all(r == {"twin": True, "twin_split": True, "loaded": True, "loaded_split": False} for r in results)
