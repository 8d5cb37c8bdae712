"""The fast decoder keeps diffusers' conventions, with real diffusers pipelines of seeded tiny weights: the decode's
progress bar is the pipeline's own (`set_progress_bar_config`, `disable=True` included), the package exports what a
diffusers user imports, a decoder made from a module runs where the module is, an option that cannot work is
refused by `enable_fast_decode` itself, before any denoising, and what diffusers' hooks change (layerwise casting,
forward hooks) runs diffusers' own encode and decode with one warning naming the cause."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _diffusers_pipelines import call_kwargs, tiny_pipeline, tiny_vae

import fastvideo_pan2_ext
from fastvideo_pan2_ext import enable_fast_decode, enable_fast_encode
from fastvideo_pan2_ext.diffusers_integration import fast_decode as diffusers_decode
from fastvideo_pan2_ext.diffusers_integration import fast_encode as diffusers_encode
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder


def test_the_decode_progress_bar_is_the_pipelines_own(capfd):
    pipe = tiny_pipeline("wan2.1")
    enable_fast_decode(pipe, backend="torch", frames_per_pass=1)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(**call_kwargs("wan2.1"))
    assert "VAE decode" not in capfd.readouterr().err

    pipe.set_progress_bar_config(disable=False, ascii=True)
    with torch.no_grad():
        pipe(**call_kwargs("wan2.1"))  # 9 frames: 3 latent frames, one pass each
    bars = capfd.readouterr().err
    assert "VAE decode: 100%|##########| 3/3" in bars, bars  # the pipeline's config (ascii) shapes it


def test_the_package_exports_what_a_diffusers_user_imports():
    assert fastvideo_pan2_ext.WanVAEDecoder is WanVAEDecoder
    assert fastvideo_pan2_ext.is_fast_decode_enabled is diffusers_decode.is_fast_decode_enabled
    assert {"WanVAEDecoder", "is_fast_decode_enabled"} <= set(fastvideo_pan2_ext.__all__)


def test_a_decoder_made_from_a_module_runs_where_the_module_is():
    vae = tiny_vae("wan2.1")
    assert WanVAEDecoder(vae, backend="torch").device == next(vae.parameters()).device


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU takes backend='cuda'")
def test_backend_cuda_without_a_gpu_is_refused_when_enabled():
    pipe = tiny_pipeline("wan2.1")
    with pytest.raises(ValueError, match=r"^backend='cuda' runs the compiled kernels on a GPU, but torch sees none"):
        enable_fast_decode(pipe, backend="cuda")
    assert not diffusers_decode.is_fast_decode_enabled(pipe)


def test_options_that_cannot_work_are_refused_when_enabled_not_after_the_denoise():
    pipe = tiny_pipeline("wan2.1")
    with pytest.raises(ValueError, match=r"^max_memory='1KiB' is below what any decode needs: .* too small to decode "
                                         r"latents \[1, 16, 1, 1, 1\] even in one-row tiles: that needs at least "):
        enable_fast_decode(pipe, max_memory="1KiB")
    with pytest.raises(ValueError, match=r"^unknown decoder option\(s\) tile_size; the options are frames_per_pass"):
        enable_fast_decode(pipe, tile_size=2)
    assert not diffusers_decode.is_fast_decode_enabled(pipe)
    enable_fast_decode(pipe, max_memory="64MiB")  # a budget the smallest decode fits is taken
    assert diffusers_decode.is_fast_decode_enabled(pipe)


def _both_methods(vae, video):
    """(moments, video) of diffusers' own encode and decode (the class's methods: no route)."""
    with torch.no_grad():
        moments = type(vae).encode(vae, video).latent_dist.parameters
        return moments, type(vae).decode(vae, moments[:, :vae.config.z_dim]).sample


def _layerwise(storage):
    vae = tiny_vae("wan2.1")
    vae.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    return vae


def _hooked(part):
    vae = tiny_vae("wan2.1")
    getattr(vae, part).conv_in.register_forward_hook(lambda module, inputs, output: output * 0.5)
    return vae


# What diffusers computes that a fused worker would not: its layerwise casting (any storage dtype: float8 has no
# arithmetic of its own) changes both methods, a forward hook the method whose layer holds it.
@pytest.mark.parametrize("make, changed, message", [
    (lambda: _layerwise(torch.bfloat16), ("encode", "decode"),
     r"under diffusers' layerwise casting .*stored in torch\.bfloat16, each layer computing in torch\.float32"),
    (lambda: _layerwise(torch.float8_e4m3fn), ("encode", "decode"),
     r"under diffusers' layerwise casting .*torch\.float8_e4m3fn"),
    (lambda: _hooked("encoder"), ("encode",), r"vae\.encoder\.conv_in has a forward hook"),
    (lambda: _hooked("decoder"), ("decode",), r"vae\.decoder\.conv_in has a forward hook"),
], ids=["layerwise-bf16", "layerwise-fp8", "hook-encoder", "hook-decoder"])
def test_what_diffusers_hooks_change_runs_diffusers_own_method_with_one_warning(make, changed, message):
    vae = make()
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    expected = dict(zip(("encode", "decode"), _both_methods(vae, video)))
    enable_fast_encode(vae)
    enable_fast_decode(vae)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.no_grad():
                ours = {"encode": vae.encode(video).latent_dist.parameters,
                        "decode": vae.decode(expected["encode"][:, :16]).sample}
            for method in changed:  # diffusers' own result, its dtype included
                assert torch.equal(ours[method], expected[method]), method
    lines = [str(w.message) for w in caught]
    assert len(lines) == len(changed), lines  # one per method it changes, once per VAE
    for method, line in zip(changed, lines):
        assert re.search(message, line) and line.startswith(f"enable_fast_{method}: ") and \
            line.endswith(f"ing with diffusers' {method}"), line


def test_fallback_warnings_name_the_cause_not_a_state_dict_key():
    from diffusers import AutoencoderKLWan

    compiled = tiny_vae("wan2.1")
    compiled.encoder = torch.compile(compiled.encoder)
    assert diffusers_encode.unsupported_reason(compiled) == ("vae.encoder is compiled by torch.compile, which only "
                                                             "diffusers' encode runs")
    attention = AutoencoderKLWan(base_dim=4, z_dim=4, attn_scales=[0.5])
    assert diffusers_decode.unsupported_reason(attention).startswith("its config has attn_scales [0.5]")
    float8 = tiny_vae("wan2.1").to(torch.float8_e4m3fn)
    assert diffusers_encode.unsupported_reason(float8) == ("its encoder's weights are torch.float8_e4m3fn; it takes "
                                                           "float32, bfloat16, float16 or float64 weights")
