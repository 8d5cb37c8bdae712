"""The fast decoder after the denoise, as serving code runs a model: decoding under `torch.inference_mode()`
(diffusers' pipelines and FastVideo's decoding stage, on both kinds of CPU), and on a VAE whose weights were made under
it."""

from __future__ import annotations

import weakref

import pytest
import torch
from _diffusers_pipelines import call_kwargs, tiny_pipeline, tiny_vae
from _pan2_helpers import forward_batch

from fastvideo_pan2_ext import enable_fast_decode
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.portable import ops, weights

LAYOUT = "wan2.2-ti2v"


def _latents(vae, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, vae.config.z_dim, 3, 4, 2, generator=torch.Generator().manual_seed(seed))


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


def test_fastvideo_decoding_stage_under_inference_mode(pan2, tiny_ckpt, cpu_compute, monkeypatch):
    """FastVideo's decoding stage with the fast decoder on, run under inference_mode (the decoder built there), gives
    the video it gives without."""
    from fastvideo_pan2_ext.integration import fast_decode

    pipeline, args = pan2
    stage = pipeline._stage_name_mapping["decoding_stage"]
    latents = torch.randn(1, 48, 2, 3, 2, generator=torch.Generator().manual_seed(3))

    def decode() -> torch.Tensor:
        monkeypatch.setattr(fast_decode, "_decoders", weakref.WeakKeyDictionary())  # built in this mode
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
