"""`enable_fast_encode` on diffusers' own AutoencoderKLWan and on the real Wan pipelines that encode
(docs/design/diffusers-integration.md, "The fast decoder and encoder in diffusers"), seeded random weights at narrow
widths: the moments within rounding of diffusers' fp32 encode (mean and logvar each), diffusers' own distribution (mode,
mean, clamped logvar, the same draw from the same generator), return types, slicing, `enable_tiling()` as exact tiles,
the fallbacks (autograd, a VAE outside the architecture, one offloaded layer by layer) with one warning, offload hooks
first, copies, the option checks, the two switches independent of each other, and the pipelines (Wan2.1 and Wan2.2
image-to-video, video-to-video, VACE) within a tight bound of diffusers' with the switch on, and diffusers' bit for bit
after `disable_fast_encode`."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from _diffusers_pipelines import ENCODE_LAYOUTS, call_kwargs, tiny_pipeline, tiny_vae
from _threads import torch_threads
from _vae_helpers import make_wan21_vae, make_wan22_vae, randomize_parameters_
from accelerate import cpu_offload
from accelerate.hooks import ModelHook, add_hook_to_module
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput

import fastvideo_pan2_ext
from fastvideo_pan2_ext import (disable_fast_decode, disable_fast_encode, enable_fast_decode, enable_fast_encode,
                                is_fast_decode_enabled, is_fast_encode_enabled)
from fastvideo_pan2_ext.diffusers_integration import fast_encode as diffusers_encode
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32
from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder

ROUNDING = 1e-4  # fp32 moments: differences of summation order, relative to the moments' largest magnitude


def _video(b=1, f=5, h=32, w=32, seed=0) -> torch.Tensor:
    return torch.rand(b, 3, f, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _diffusers(vae, x, **kwargs):
    with torch.no_grad(), exact_fp32():
        return type(vae).encode(vae, x, **kwargs)


def _fast(vae, x, *args, **kwargs):
    with torch.no_grad():
        return vae.encode(x, *args, **kwargs)


def _encoder(vae) -> WanVAEEncoder | None:
    return vae.__dict__["_pan2_fast_encode"].worker


def _spy(encoder: WanVAEEncoder) -> list:
    """Record the (video, plan) of every encode the fast encoder runs (the real encode still runs)."""
    calls, encode = [], encoder.encode

    def recording(video):
        moments = encode(video)
        calls.append((video.clone(), encoder.last_plan))
        return moments

    encoder.encode = recording
    return calls


def assert_within_rounding(candidate: torch.Tensor, reference: torch.Tensor) -> None:
    assert candidate.shape == reference.shape and candidate.dtype == reference.dtype
    error = float((candidate.double() - reference.double()).abs().max())
    assert error <= ROUNDING * max(1.0, float(reference.abs().max())), error


# Configurations diffusers builds, each with a video [B, 3, F, H, W] it takes: its own test models (Wan2.1 base 3 x
# [1, 1, 1, 1], one res block; the Wan2.2 5B test model with 48 latent channels; batch > 1, three latent frames), the
# narrow real layouts, odd widths.
CONFIGS = {
    "diffusers-test-wan2.1": (lambda: tiny_vae("wan2.1"), (2, 9, 40, 24)),
    "diffusers-test-wan2.2": (lambda: tiny_vae("wan2.2-ti2v"), (2, 9, 32, 48)),
    "wan2.2-narrow": (make_wan22_vae, (1, 5, 32, 32)),
    "wan2.1-narrow": (make_wan21_vae, (1, 5, 24, 16)),
    "wan2.1-odd-widths": (lambda: randomize_parameters_(AutoencoderKLWan(base_dim=5, z_dim=7, dim_mult=[1, 3, 2, 2],
                                                                         num_res_blocks=1), 3).eval(), (1, 5, 16, 24)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_encodes_within_rounding_of_diffusers_fp32(name):
    make, (b, f, h, w) = CONFIGS[name]
    vae = make()
    x = _video(b, f, h, w)
    reference = _diffusers(vae, x).latent_dist
    enable_fast_encode(vae)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # encoded by us: no fallback warning
        out = _fast(vae, x)
    assert type(out) is AutoencoderKLOutput and type(out.latent_dist) is DiagonalGaussianDistribution
    assert _encoder(vae) is not None and _encoder(vae).last_plan is not None  # the fast encoder ran
    assert_within_rounding(out.latent_dist.mean, reference.mean)
    assert_within_rounding(out.latent_dist.logvar, reference.logvar)


def test_the_distribution_is_diffusers_own_and_draws_what_diffusers_draws():
    vae = tiny_vae("wan2.1")
    with torch.no_grad():  # logvar far outside [-30, 20] on some channels, so that the clamp matters
        vae.quant_conv.weight[16:24].mul_(400.0)
    x = _video(b=2)
    reference = _diffusers(vae, x).latent_dist
    enable_fast_encode(vae)
    fast = _fast(vae, x).latent_dist
    z = vae.config.z_dim
    raw_logvar = fast.parameters[:, z:]
    assert raw_logvar.max() > 20 and raw_logvar.min() < -30
    assert torch.equal(fast.logvar, raw_logvar.clamp(-30.0, 20.0)) and torch.equal(fast.mean, fast.parameters[:, :z])
    assert_within_rounding(fast.logvar, reference.logvar)
    assert torch.equal(fast.mode(), fast.mean)
    assert_within_rounding(fast.mode(), reference.mode())
    mine, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    drawn, expected = fast.sample(mine), reference.sample(theirs)
    assert drawn.dtype == expected.dtype and torch.equal(mine.get_state(), theirs.get_state())
    # The same noise: what is left is the moments' rounding (std up to e^10 on the clamped channels).
    noise = (drawn - fast.mean) / fast.std
    assert torch.allclose(noise, (expected - reference.mean) / reference.std, atol=1e-3)
    assert_within_rounding(drawn, expected)


def test_return_dict_false_and_dtypes_are_diffusers():
    vae = tiny_vae("wan2.1")
    x = _video()
    enable_fast_encode(vae)
    as_tuple = _fast(vae, x, return_dict=False)
    positional = _fast(vae, x, False)
    assert type(as_tuple) is tuple and len(as_tuple) == 1 and type(as_tuple[0]) is DiagonalGaussianDistribution
    assert torch.equal(as_tuple[0].parameters, positional[0].parameters)
    assert as_tuple[0].parameters.dtype == torch.float32 and _encoder(vae).dtype == torch.float32
    vae.to(torch.bfloat16)  # a bf16 VAE: encoded in bf16, as diffusers' own encode of it computes
    fast = _fast(vae, x.bfloat16()).latent_dist
    reference = _diffusers(vae, x.bfloat16()).latent_dist
    assert fast.parameters.dtype == reference.parameters.dtype == torch.bfloat16 and _encoder(vae).dtype == \
        torch.bfloat16
    assert fast.parameters.shape == reference.parameters.shape
    enable_fast_encode(vae, precision="fp32")  # the option: fp32 arithmetic, bf16 moments as the VAE's
    assert _fast(vae, x.bfloat16()).latent_dist.parameters.dtype == torch.bfloat16
    assert _encoder(vae).dtype == torch.float32


def test_disable_restores_diffusers_bit_for_bit_and_each_switch_leaves_the_other_method_alone():
    vae = tiny_vae("wan2.1")
    x = _video()
    z = torch.randn(1, vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    diffusers_moments = _diffusers(vae, x).latent_dist.parameters
    with torch.no_grad(), exact_fp32():
        diffusers_video = vae.decode(z).sample

    enable_fast_decode(vae)  # the decode only
    assert "encode" not in vae.__dict__ and not is_fast_encode_enabled(vae)
    with exact_fp32():
        assert torch.equal(_fast(vae, x).latent_dist.parameters, diffusers_moments)
    with torch.no_grad():
        fast_video = vae.decode(z).sample
    assert not torch.equal(fast_video, diffusers_video)  # the fast decoder's bf16 video

    enable_fast_encode(vae)  # both
    fast_moments = _fast(vae, x).latent_dist.parameters
    assert _encoder(vae).last_plan is not None
    assert_within_rounding(fast_moments, diffusers_moments)
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, fast_video)

    disable_fast_encode(vae)  # the decode stays fast
    assert not is_fast_encode_enabled(vae) and is_fast_decode_enabled(vae) and "encode" not in vae.__dict__
    with exact_fp32():
        assert torch.equal(_fast(vae, x).latent_dist.parameters, diffusers_moments)
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, fast_video)
    disable_fast_encode(vae)  # twice: nothing to do

    enable_fast_encode(vae)
    disable_fast_decode(vae)  # the encode stays fast
    assert is_fast_encode_enabled(vae) and "decode" not in vae.__dict__ and "_apply" in vae.__dict__
    assert torch.equal(_fast(vae, x).latent_dist.parameters, fast_moments)
    with torch.no_grad(), exact_fp32():
        assert torch.equal(vae.decode(z).sample, diffusers_video)
    disable_fast_encode(vae)
    assert not {"encode", "decode", "_apply", "_pan2_fast_encode"} & set(vae.__dict__)  # diffusers' own VAE again


def test_slicing_encodes_the_batch_one_element_after_another_with_the_same_moments():
    vae = tiny_vae("wan2.1")
    x = _video(b=3, f=9)
    enable_fast_encode(vae)
    with torch_threads(1):
        whole = _fast(vae, x).latent_dist.parameters
        calls = _spy(_encoder(vae))
        vae.enable_slicing()
        sliced = _fast(vae, x).latent_dist.parameters
    assert [video.shape[0] for video, _ in calls] == [1, 1, 1]
    assert torch.equal(sliced, whole)


def test_enable_tiling_gives_exact_tiles_sized_from_diffusers_tile_height():
    vae = make_wan21_vae()  # 8x spatial
    x = _video(f=5, h=64, w=48)
    enable_fast_encode(vae)
    with torch_threads(1):  # plans compared bit for bit run at one thread
        untiled = _fast(vae, x).latent_dist.parameters
        calls = _spy(_encoder(vae))
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                          tile_sample_stride_width=16)
        tiled = _fast(vae, x).latent_dist.parameters
    assert calls[-1][1].tile_rows == 32 // 8
    assert torch.equal(tiled, untiled)  # exact two-phase tiles: no seams
    # diffusers' own blended tiles at the same settings are not the untiled moments (the seams this removes).
    disable_fast_encode(vae)
    blended = _diffusers(vae, x).latent_dist.parameters
    assert (blended - untiled).abs().max() > 1e-2
    enable_fast_encode(vae, tile_rows=1)  # the options' tiles apply whatever diffusers' switch says
    _fast(vae, x)
    assert _encoder(vae).last_plan.tile_rows == 1
    vae.disable_tiling()
    _fast(vae, x)
    assert _encoder(vae).last_plan.tile_rows == 1


def test_tiles_only_where_diffusers_would_tile_its_encode():
    """diffusers tiles an encode whose patchified video is larger than its tile (Wan2.2: patch 2, so a 64-pixel
    video is 32 patches: untiled under 32-pixel tiles); so does the fast encoder."""
    vae = tiny_vae("wan2.2-ti2v")  # 16x spatial, patch size 2
    enable_fast_encode(vae)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)
    _fast(vae, _video(h=64, w=64))
    assert _encoder(vae).last_plan.tile_rows is None
    _fast(vae, _video(h=96, w=64))
    assert _encoder(vae).last_plan.tile_rows == 32 // 8  # diffusers' encode tile: 32 patchified rows, 8 a latent row


def test_autograd_goes_through_diffusers_encode_with_one_warning_and_gradients_flow():
    vae = tiny_vae("wan2.1")
    x = _video().requires_grad_(True)
    enable_fast_encode(vae)
    with pytest.warns(UserWarning, match="enable_fast_encode: autograd is recording through this encode"):
        out = vae.encode(x).latent_dist.mean
    with exact_fp32():
        expected = type(vae).encode(vae, x.detach()).latent_dist.mean
    assert out.grad_fn is not None and torch.equal(out.detach(), expected)
    out.square().mean().backward()
    assert x.grad is not None and vae.encoder.conv_in.weight.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per VAE
        vae.encode(x)
    vae.requires_grad_(False)
    assert vae.encode(x.detach()).latent_dist.mean.grad_fn is None and _encoder(vae) is not None  # inference


def test_a_training_step_through_forward_updates_the_encoder():
    """diffusers' training check with both switches on: forward() (encode + decode) in train mode, a loss, backward,
    every encoder weight gets a gradient."""
    vae = tiny_vae("wan2.1").train()
    enable_fast_encode(vae)
    enable_fast_decode(vae)
    sample = _video(b=2, f=5, h=16, w=16)
    with pytest.warns(UserWarning, match="autograd"):
        out = vae(sample).sample
    torch.nn.functional.mse_loss(out, torch.zeros_like(out)).backward()
    assert all(p.grad is not None for p in vae.encoder.parameters())


def test_a_vae_outside_the_architecture_falls_back_to_diffusers_with_one_warning():
    # One temporal downsampling level: diffusers builds it; the fast encoder implements Wan's 4x in time only.
    vae = randomize_parameters_(AutoencoderKLWan(base_dim=4, z_dim=4, temperal_downsample=[False, False, True]), 1)
    x = _video()
    expected = _diffusers(vae.eval(), x).latent_dist.parameters
    enable_fast_encode(vae)
    with pytest.warns(UserWarning, match="outside the fast encoder's architecture .*downsamples in time at 1 level"):
        with exact_fp32():
            first = _fast(vae, x).latent_dist.parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with exact_fp32():
            second = _fast(vae, x).latent_dist.parameters
    assert torch.equal(first, expected) and torch.equal(second, expected) and _encoder(vae) is None


def test_a_vae_offloaded_layer_by_layer_is_encoded_by_diffusers_after_one_warning():
    reference = tiny_vae("wan2.1")
    vae = tiny_vae("wan2.1")
    cpu_offload(vae, torch.device("cpu"))  # what diffusers' enable_sequential_cpu_offload does to each model
    enable_fast_encode(vae)
    x = _video()
    with pytest.warns(UserWarning, match="offloaded layer by layer"):
        moments = _fast(vae, x).latent_dist.parameters
    assert torch.equal(moments, _diffusers(reference, x).latent_dist.parameters)


class _LoadWeights(ModelHook):
    """An offload hook: the weights arrive at pre_forward (as accelerate's CpuOffload moves a model to its device)."""

    def __init__(self, state_dict) -> None:
        self.state_dict = state_dict

    def pre_forward(self, module, *args, **kwargs):
        module.load_state_dict(self.state_dict)
        return args, kwargs


def test_the_offload_hook_runs_before_the_fast_encoder_as_diffusers_apply_forward_hook_would():
    loaded = tiny_vae("wan2.1", seed=0)
    vae = tiny_vae("wan2.1", seed=5)  # other weights until the hook loads them
    add_hook_to_module(vae, _LoadWeights(loaded.state_dict()))
    enable_fast_encode(vae)
    x = _video()
    assert_within_rounding(_fast(vae, x).latent_dist.parameters, _diffusers(loaded, x).latent_dist.parameters)


def test_the_encoder_leaves_a_device_the_vae_leaves_and_copies_keep_the_switch():
    vae = tiny_vae("wan2.1")
    x = _video()
    enable_fast_encode(vae, frames_per_pass=1)
    moments = _fast(vae, x).latent_dist.parameters
    saved = {k: v.clone() for k, v in vae.state_dict().items()}
    encoder = _encoder(vae)
    vae.to("meta")  # the VAE leaves the device: the encoder's prepared weights leave too (the decoder's way)
    assert _encoder(vae) is encoder and not encoder.weights
    vae.to_empty(device="cpu")
    vae.load_state_dict(saved)
    assert torch.equal(_fast(vae, x).latent_dist.parameters, moments)

    twin = copy.deepcopy(vae)
    buffer = io.BytesIO()
    torch.save(vae, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert is_fast_encode_enabled(other) and not is_fast_decode_enabled(other)
        assert torch.equal(_fast(other, x).latent_dist.parameters, moments)
        assert _encoder(other) is not _encoder(vae) and _encoder(other).last_plan.frames_per_pass == 1


def test_the_encode_progress_bar_is_the_pipelines_own(capfd):
    pipe = tiny_pipeline("i2v")
    enable_fast_encode(pipe, frames_per_pass=1)
    pipe.set_progress_bar_config(disable=False, ascii=True)
    pipe(**call_kwargs("i2v", 32, 32))  # 9 frames: 3 latent frames, one pass each
    assert "VAE encode: 100%|##########| 3/3" in capfd.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"frames_per_pass": 0}, "frames_per_pass must be 'auto' or an int >= 1"),
    ({"tile_rows": 2, "max_memory": "1GiB"}, "set tile_rows or max_memory, not both"),
    ({"max_memory": "lots"}, "max_memory"),
    ({"max_memory": "1KiB"}, r"max_memory='1KiB' is below what any encode needs"),
    ({"backend": "tpu"}, "backend must be one of"),
    ({"precision": "fp64"}, "precision must be one of"),
    ({"reuse_steady": "yes"}, "reuse_steady must be True or False"),
    ({"conv_algorithm": "winograd"}, r"unknown encoder option\(s\) conv_algorithm; the options are frames_per_pass"),
])
def test_bad_options_are_refused_at_the_call_in_one_line(options, message):
    vae = tiny_vae("wan2.1")
    with pytest.raises(ValueError, match=message) as caught:
        enable_fast_encode(vae, **options)
    assert "\n" not in str(caught.value)
    assert not is_fast_encode_enabled(vae) and "encode" not in vae.__dict__


def test_backend_cuda_is_refused_when_enabled_without_a_gpu():
    """backend='cuda' means the compiled kernels or an error: without a GPU, refused at the call, as the decode
    switch refuses it."""
    with pytest.raises(ValueError, match=r"^backend='cuda' runs the compiled kernels on a GPU, but torch sees none"):
        enable_fast_encode(tiny_vae("wan2.1"), backend="cuda")


def test_bad_targets_are_refused_and_the_package_exports_the_switch():
    with pytest.raises(ValueError, match="AutoencoderKLWan or a pipeline whose .vae is one; got Linear"):
        enable_fast_encode(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="got Linear"):
        disable_fast_encode(torch.nn.Linear(1, 1))
    assert fastvideo_pan2_ext.enable_fast_encode is diffusers_encode.enable_fast_encode
    assert {"enable_fast_encode", "disable_fast_encode", "is_fast_encode_enabled"} <= set(fastvideo_pan2_ext.__all__)


def test_videos_the_encoder_refuses_raise_a_clear_error():
    vae = tiny_vae("wan2.2-ti2v")
    enable_fast_encode(vae)
    bad = _video()
    bad[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        _fast(vae, bad)
    with pytest.raises(ValueError, match="multiples of 16"):
        _fast(vae, _video(h=24, w=32))


# ------------------------------------------------------------------------------------------------ the pipelines


def _frames(pipe, layout):
    with exact_fp32():
        return pipe(**call_kwargs(layout, 32, 32, num_frames=5)).frames


@pytest.mark.parametrize("layout", ENCODE_LAYOUTS)
def test_pipeline_video_with_the_fast_encoder(layout):
    pipe = tiny_pipeline(layout)
    pipe.set_progress_bar_config(disable=True)
    reference = _frames(pipe, layout)  # diffusers' encode, fp32 VAE

    enable_fast_encode(pipe)
    route = pipe.vae.__dict__["_pan2_fast_encode"]
    route.worker = route.make(pipe.vae)  # what the first encode would make, with a spy on it
    calls = _spy(route.worker)
    fast = _frames(pipe, layout)
    assert calls, "the pipeline's encode did not reach the fast encoder"
    assert type(fast) is type(reference) and fast.shape == reference.shape and fast.dtype == reference.dtype
    for video, _ in list(calls):  # each video the pipeline encoded: moments within rounding of diffusers'
        assert_within_rounding(route.worker.encode(video), _diffusers(pipe.vae, video).latent_dist.parameters)
    error = float((fast - reference).abs().max())
    assert error <= 1e-4, error  # frames in [0, 1], a few denoising steps from moments within rounding

    disable_fast_encode(pipe)
    assert torch.equal(_frames(pipe, layout), reference)  # diffusers' encode restored, bit for bit
