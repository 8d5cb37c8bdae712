"""The fast decoder keeps diffusers' conventions, with real diffusers pipelines of seeded tiny weights: the decode's
progress bar is the pipeline's own (`set_progress_bar_config`, `disable=True` included), the package exports what a
diffusers user imports, a decoder made from a module runs where the module is, and an option that cannot work is
refused by `enable_fast_decode` itself, before any denoising."""

from __future__ import annotations

import pytest
import torch
from _diffusers_pipelines import call_kwargs, tiny_pipeline, tiny_vae

import fastvideo_pan2_ext
from fastvideo_pan2_ext import diffusers_decode, enable_fast_decode
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
