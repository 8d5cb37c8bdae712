"""`reference.decode` against its definition: diffusers 0.42.x `AutoencoderKLWan.decode(z).sample`, bit for bit.

The oracles are the real diffusers models of both layouts at narrow widths (base_dim 8, z_dim 8, dim_mult [1, 2, 4, 4],
num_res_blocks 2) with every parameter seeded random (tests/_vae_helpers.py), and the same weights handed to
`reference.decode` as a state dict: Wan2.2 (`is_residual=True`, `patch_size=2`, 16x) and Wan2.1 (`is_residual=False`,
no patchify, 8x; its up blocks have no DupUp shortcut and its upsamplers halve the width).

Bit-exactness matrix (`torch.equal`), latents seeded standard normal (about 7 % of the output saturates, so the final
clamp is exercised too); latent sizes h x w: 3 x 5 (odd, wide), 7 x 4 (odd, tall), 4 x 4 (even, square), i.e.
48 x 80, 112 x 64, 64 x 64 pixels; T = 1, 2, 3, 5 latent frames (1, 5, 9, 17 video frames); batch 2 holds two
different latents.
    float32   the full product T x batch x size: 4 x 2 x 3 = 24 cases
    bfloat16  every (T, batch) pair once, sizes rotating so each size meets both batches and two or three T: 8 cases
              T1-B1 7x4, T1-B2 3x5, T2-B1 3x5, T2-B2 4x4, T3-B1 4x4, T3-B2 7x4, T5-B1 7x4, T5-B2 3x5
each for both layouts. CPU bf16 convs are slow (the full bf16 product alone takes minutes on 2 cores), so the default
run covers bf16 this way; `PAN2_FULL_DECODE_MATRIX=1` runs the full product in both dtypes (48 cases per layout).
"""

from __future__ import annotations

import copy
import itertools
import os
import re

import pytest
import torch

from _vae_helpers import diffusers_decode, make_wan21_vae, random_latents, random_wan22_decoder_weights
from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (WAN21_CONFIG, WAN22_CONFIG, decoder_state_dict,
                                                        expected_shapes, infer_config)
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32

Z_DIM = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALE = {"wan22": 16, "wan21": 8}  # video pixels per latent pixel
FRAMES = (1, 2, 3, 5)
BATCHES = (1, 2)
SIZES = ((3, 5), (7, 4), (4, 4))
FULL_PRODUCT = list(itertools.product(DTYPES, FRAMES, BATCHES, SIZES))
BF16_COVER = [
    ("bf16", 1, 1, (7, 4)), ("bf16", 1, 2, (3, 5)), ("bf16", 2, 1, (3, 5)), ("bf16", 2, 2, (4, 4)),
    ("bf16", 3, 1, (4, 4)), ("bf16", 3, 2, (7, 4)), ("bf16", 5, 1, (7, 4)), ("bf16", 5, 2, (3, 5)),
]
if os.environ.get("PAN2_FULL_DECODE_MATRIX") == "1":
    MATRIX = FULL_PRODUCT
else:
    MATRIX = [case for case in FULL_PRODUCT if case[0] == "fp32"] + BF16_COVER


@pytest.fixture(scope="module")
def wan21_vae():
    return make_wan21_vae(seed=0)


@pytest.fixture(scope="module")
def models(wan22_vae, wan22_state_dict, wan21_vae):
    """(diffusers model, its state dict) per layout."""
    return {"wan22": (wan22_vae, wan22_state_dict), "wan21": (wan21_vae, wan21_vae.state_dict())}


@pytest.fixture(scope="module")
def oracles(models):
    """Each diffusers model cast once per dtype (a cast is in place, so each gets its own copy)."""
    return {(layout, name): copy.deepcopy(vae).to(dtype) for layout, (vae, _) in models.items()
            for name, dtype in DTYPES.items()}


def _decoder_only(state_dict):
    return {k: v for k, v in state_dict.items() if k.startswith(("decoder.", "post_quant_conv."))}


# --- bit-exactness ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", SCALE)
@pytest.mark.parametrize(
    "dtype_name, frames, batch, size", MATRIX, ids=[f"{d}-T{t}-B{b}-{h}x{w}" for d, t, b, (h, w) in MATRIX]
)
def test_decode_is_bit_exact_with_diffusers(oracles, models, layout, dtype_name, frames, batch, size):
    dtype = DTYPES[dtype_name]
    h, w = size
    z = random_latents((batch, Z_DIM, frames, h, w), seed=FULL_PRODUCT.index((dtype_name, frames, batch, size)))

    expected = diffusers_decode(oracles[layout, dtype_name], z, dtype)
    video = reference.decode(z, models[layout][1], dtype)

    assert video.dtype == dtype
    s = SCALE[layout]
    assert video.shape == (batch, 3, 4 * frames - 3, s * h, s * w)
    assert torch.equal(video, expected), (
        f"max |reference - diffusers| = {(video.float() - expected.float()).abs().max().item()}"
    )


def test_decoder_only_state_dict_decodes_like_the_whole_one(wan22_state_dict):
    z = random_latents((1, Z_DIM, 2, 3, 5), seed=100)
    whole = reference.decode(z, wan22_state_dict)
    decoder_only = _decoder_only(wan22_state_dict)
    assert not any(k.startswith(("encoder.", "quant_conv.")) for k in decoder_only)
    assert torch.equal(reference.decode(z, decoder_only), whole)


# --- output shape and range ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 6])
def test_output_has_4t_minus_3_frames_at_16x_the_latent_size(wan22_state_dict, frames):
    z = random_latents((1, Z_DIM, frames, 1, 2), seed=200 + frames)
    assert reference.decode(z, wan22_state_dict).shape == (1, 3, 4 * frames - 3, 16, 32)


def test_output_is_clamped_to_unit_range(oracles, wan22_state_dict):
    # Scaling conv_out by 50 drives most outputs far past +-1: they must come back exactly at the bounds.
    loud = dict(wan22_state_dict)
    loud["decoder.conv_out.weight"] = wan22_state_dict["decoder.conv_out.weight"] * 50
    z = random_latents((1, Z_DIM, 2, 3, 5), seed=300)
    video = reference.decode(z, loud)
    assert video.min().item() == -1.0 and video.max().item() == 1.0
    assert (video.abs() == 1.0).float().mean().item() > 0.5

    vae = copy.deepcopy(oracles["wan22", "fp32"])
    vae.load_state_dict(loud)
    assert torch.equal(video, diffusers_decode(vae, z, torch.float32))


def test_decode_leaves_its_inputs_untouched(wan22_state_dict):
    z = random_latents((1, Z_DIM, 2, 3, 5), seed=400)
    z_before = z.clone()
    sd = {k: v.clone() for k, v in wan22_state_dict.items()}
    reference.decode(z, sd, torch.bfloat16)
    reference.decode(z, sd, torch.float32)
    assert torch.equal(z, z_before)
    assert all(torch.equal(sd[k], wan22_state_dict[k]) and sd[k].dtype == torch.float32 for k in sd)


# --- TF32 is off during the decode and restored after it ------------------------------------------------------------


class _RecordTF32AtConvs(torch.overrides.TorchFunctionMode):
    """Records the TF32 flags at every conv the decoder runs (observes real calls; changes nothing)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.nn.functional.conv3d, torch.nn.functional.conv2d):
            self.seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def restore_tf32_flags():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _decode_recording_tf32(z, state_dict, dtype=torch.float32):
    recorder = _RecordTF32AtConvs()
    with recorder:
        video = reference.decode(z, state_dict, dtype)
    return video, recorder.seen


@pytest.mark.parametrize("initial", [(True, True), (False, False), (True, False)])
def test_decode_turns_tf32_off_for_its_run_and_restores_it(wan22_state_dict, restore_tf32_flags, initial):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = initial
    _, seen = _decode_recording_tf32(random_latents((1, Z_DIM, 2, 1, 2), seed=500), wan22_state_dict)
    assert len(seen) > 50  # every conv of the decoder was observed
    assert set(seen) == {(False, False)}
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == initial


def test_tf32_flags_are_restored_when_the_decode_raises(restore_tf32_flags):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    with pytest.raises(RuntimeError, match="boom"):
        with exact_fp32():
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError("boom")
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_is_true_fp32_with_tf32_enabled_globally(restore_tf32_flags):
    weights = random_wan22_decoder_weights(seed=7)  # no diffusers needed on the GPU machine
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    z = random_latents((1, Z_DIM, 3, 4, 4), seed=600)
    video, seen = _decode_recording_tf32(z.cuda(), weights)
    assert set(seen) == {(False, False)}
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    # TF32 (10-bit mantissa) would put the difference near 1e-3; true fp32 stays at fp32 rounding.
    assert (video.cpu() - reference.decode(z, weights)).abs().max().item() < 1e-4


# --- bad inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "latents, message",
    [
        (torch.zeros(1, Z_DIM, 2, 3), r"latents must be \[B, 8, T, H, W\]; got \[1, 8, 2, 3\]"),
        (torch.zeros(1, Z_DIM, 2, 3, 4, 1), r"latents must be \[B, 8, T, H, W\]; got \[1, 8, 2, 3, 4, 1\]"),
        (torch.zeros(1, 16, 2, 3, 4), r"latents must be \[B, 8, T, H, W\]; got \[1, 16, 2, 3, 4\]"),
        (torch.zeros(0, Z_DIM, 2, 3, 4), r"every dimension >= 1; got \[0, 8, 2, 3, 4\]"),
        (torch.zeros(1, Z_DIM, 0, 3, 4), r"every dimension >= 1; got \[1, 8, 0, 3, 4\]"),
        (torch.zeros(1, Z_DIM, 2, 0, 4), r"every dimension >= 1; got \[1, 8, 2, 0, 4\]"),
        (torch.zeros(1, Z_DIM, 2, 3, 4, dtype=torch.int64), r"floating-point tensor; got torch.int64"),
        (torch.zeros(1, Z_DIM, 2, 3, 4, dtype=torch.uint8), r"floating-point tensor; got torch.uint8"),
        ([[0.0]], r"latents must be a torch.Tensor; got list"),
    ],
    ids=["rank4", "rank6", "wrong-channels", "zero-batch", "zero-frames", "zero-height", "int64", "uint8", "list"],
)
def test_bad_latents_raise_a_clear_value_error(wan22_state_dict, latents, message):
    with pytest.raises(ValueError, match=message):
        reference.decode(latents, wan22_state_dict)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32, "float32"])
def test_unsupported_dtype_raises_a_clear_value_error(wan22_state_dict, dtype):
    with pytest.raises(ValueError, match=r"dtype must be one of \['torch.float32', 'torch.bfloat16'\]; got"):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), wan22_state_dict, dtype)


@pytest.mark.parametrize(
    "missing",
    [
        "post_quant_conv.bias",
        "decoder.conv_in.weight",
        "decoder.mid_block.attentions.0.to_qkv.weight",
        "decoder.up_blocks.0.resnets.0.conv1.weight",
        "decoder.up_blocks.1.upsampler.time_conv.bias",
        "decoder.up_blocks.2.resnets.0.conv_shortcut.weight",
        "decoder.up_blocks.3.resnets.2.norm2.gamma",
        "decoder.conv_out.weight",
    ],
)
def test_missing_weight_raises_a_value_error_naming_it(wan22_state_dict, missing):
    sd = {k: v for k, v in wan22_state_dict.items() if k != missing}
    with pytest.raises(ValueError, match=f"'{missing}'"):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


def test_time_conv_weight_missing_beside_its_bias_raises(wan22_state_dict):
    missing = "decoder.up_blocks.1.upsampler.time_conv.weight"
    sd = {k: v for k, v in wan22_state_dict.items() if k != missing}
    with pytest.raises(ValueError, match=re.escape(missing)):
        reference.decode(random_latents((1, Z_DIM, 3, 2, 2), seed=0), sd)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("post_quant_conv.weight", (8, 8, 1, 1)),
        ("decoder.mid_block.resnets.0.conv1.weight", (32, 32, 3, 3, 1)),
        ("decoder.mid_block.resnets.1.norm2.gamma", (32, 1, 1)),
        ("decoder.up_blocks.1.upsampler.resample.1.bias", (31,)),
        ("decoder.up_blocks.2.resnets.1.conv2.weight", (16, 16, 1, 3, 3)),
        ("decoder.norm_out.gamma", (16, 1, 1, 1)),
    ],
)
def test_misshapen_weight_raises_a_value_error_naming_it(wan22_state_dict, name, shape):
    sd = dict(wan22_state_dict)
    sd[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=re.escape(f"state_dict[{name!r}] has shape {list(shape)}; expected")):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


def test_conv_out_without_a_patchified_channel_count_raises(wan22_state_dict):
    sd = dict(wan22_state_dict)
    sd["decoder.conv_out.weight"] = torch.zeros(13, 8, 3, 3, 3)
    with pytest.raises(ValueError, match=r"decoder.conv_out has 13 output channels; expected 3 x p x p"):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


# --- the Wan2.1 layout --------------------------------------------------------------------------------------------


def test_infer_config_reads_the_real_wan21_and_wan22_decoders():
    """Full-size diffusers models (on the meta device: shapes, no data) give the configs, and `expected_shapes` names
    every decoder tensor of each with its shape."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        wan21 = AutoencoderKLWan()  # diffusers' defaults are the Wan2.1 VAE
        wan22 = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2,
                                 in_channels=12, out_channels=12, scale_factor_spatial=16)
    for vae, config, scale in ((wan21, WAN21_CONFIG, 8), (wan22, WAN22_CONFIG, 16)):
        sd = decoder_state_dict(vae.state_dict())
        assert infer_config(sd) == config and config.spatial_scale == scale
        assert {name: tuple(t.shape) for name, t in sd.items()} == expected_shapes(config)
    assert [WAN21_CONFIG.level_widths(i) for i in range(4)] == [(384, 384, 192), (192, 384, 192), (192, 192, 96),
                                                                (96, 96, 96)]


def test_expected_shapes_follow_the_wan21_decoders_execution_order(wan21_vae):
    """The modules diffusers runs for a later latent frame (the first skips the time convs), after post_quant_conv,
    are `expected_shapes`' order (a resnet counted as one step: diffusers runs its 1x1 shortcut first, the list
    names it last)."""
    def step(name):
        parts = name.split(".")
        return ".".join(parts[:parts.index("resnets") + 2] if "resnets" in parts else parts[:-1])

    vae = copy.deepcopy(wan21_vae)
    order = []
    for name, module in vae.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, args, name=name: order.append(step(f"{name}.weight")))
    diffusers_decode(vae, random_latents((1, Z_DIM, 2, 1, 1), seed=0), torch.float32)
    second_frame = order[len(order) - 1 - order[::-1].index("decoder.conv_in"):]
    expected = dict.fromkeys(step(name) for name in expected_shapes(infer_config(wan21_vae.state_dict())))
    assert [order[0], *dict.fromkeys(second_frame)] == list(expected)


@pytest.mark.parametrize("missing", ["decoder.up_blocks.0.upsamplers.0.time_conv.bias",
                                     "decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
                                     "decoder.up_blocks.2.upsamplers.0.resample.1.weight"])
def test_wan21_missing_weight_raises_a_value_error_naming_it(models, missing):
    sd = {k: v for k, v in models["wan21"][1].items() if k != missing}
    with pytest.raises(ValueError, match=re.escape(f"'{missing}'")):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("decoder.up_blocks.0.upsamplers.0.resample.1.weight", (32, 32, 3, 3), [16, 32, 3, 3]),  # keeps the width
        ("decoder.up_blocks.1.resnets.0.conv1.weight", (32, 32, 3, 3, 3), [32, 16, 3, 3, 3]),  # reads the full width
        ("decoder.conv_out.weight", (3, 16, 3, 3, 3), [3, 8, 3, 3, 3]),
    ],
)
def test_wan21_misshapen_weight_raises_a_value_error_naming_it(models, name, shape, expected):
    sd = dict(models["wan21"][1])
    sd[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=re.escape(f"state_dict[{name!r}] has shape {list(shape)}; expected "
                                                   f"{expected}")):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


def test_state_dict_mixing_the_two_layouts_is_refused(models):
    sd = dict(models["wan21"][1])
    sd["decoder.up_blocks.0.upsampler.resample.1.weight"] = torch.zeros(32, 32, 3, 3)
    with pytest.raises(ValueError, match=r"tensors this architecture does not use: "
                                         r"\['decoder.up_blocks.0.upsampler.resample.1.weight'\]"):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), sd)


@pytest.mark.parametrize(
    "state_dict, message",
    [
        ([("decoder.conv_in.weight", torch.zeros(1))], r"state_dict must be a dict of tensors; got list"),
        ({}, r"no 'decoder.conv_in.weight'"),
        ({"encoder.conv_in.weight": torch.zeros(8, 12, 3, 3, 3)}, r"no 'decoder.conv_in.weight'"),
        ({"decoder.conv_in.weight": [[1.0]]}, r"state_dict\['decoder.conv_in.weight'\] must be a tensor; got list"),
    ],
    ids=["list", "empty", "encoder-only", "non-tensor-value"],
)
def test_state_dict_that_is_no_wan_decoder_raises(state_dict, message):
    with pytest.raises(ValueError, match=message):
        reference.decode(random_latents((1, Z_DIM, 1, 2, 2), seed=0), state_dict)
