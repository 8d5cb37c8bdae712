"""`reference.encode` against its definition: diffusers 0.42.x `AutoencoderKLWan.encode(x).latent_dist.parameters`,
bit for bit (`torch.equal`), at the same thread count.

The oracles are real diffusers models of both layouts at narrow widths (encoder 8 wide, dim_mult [1, 2, 4, 4],
num_res_blocks 2) with every parameter seeded random (tests/_vae_helpers.py), and the same weights handed to
`reference.encode` as a state dict: Wan2.2 (`is_residual=True`, patchify 2, AvgDown3D shortcuts; sizes multiples of
16) and Wan2.1 (plain blocks, RGB in; any size >= 8, here H = 8h + r for r = 0, 1, 5, 7 and odd W). Videos are seeded
uniform in [-1, 1].

Matrix: F = 1, 5, 9, 17 (1 + 4k) and 6 (its last frame dropped, as diffusers drops it), batch 1 and 2.
    float32   every (F, batch), sizes rotating: 10 cases per layout
    bfloat16  every F once, batches alternating: 5 cases per layout (CPU bf16 convs are slow)
A batch of two is encoded whole, as diffusers encodes it without slicing. With `enable_slicing()` diffusers encodes
each sample alone, and that equals `reference.encode` of each sample alone; it is not always bit-identical to the
whole batch in fp32, because torch's CPU kernels choose their path by the batch: an fp32 conv runs through oneDNN
for a batch of two but through torch's own conv for one sample of a small frame (oneDNN's log shows no conv for the
latter), the attention's 1x1 output projection runs channels-last for a batch but channels-first for one sample, and
an elementwise op (SiLU) computes the last elements of a tensor whose size is not a multiple of the vector width with
scalar code. bf16 convs always run through oneDNN.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _vae_helpers import make_wan21_vae, make_wan22_vae
from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import encoded_shape, infer_encoder_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FRAMES = (1, 5, 9, 17, 6)
SIZES = {"wan22": ((32, 48), (48, 16), (16, 32)), "wan21": ((17, 23), (21, 13), (15, 9), (24, 11))}
FP32 = [("fp32", f, b) for f in FRAMES for b in (1, 2)]
BF16 = [("bf16", f, 1 + (k + 1) % 2) for k, f in enumerate(FRAMES)]
MATRIX = [(layout, *case, SIZES[layout][k % len(SIZES[layout])])
          for layout in SIZES for k, case in enumerate(FP32 + BF16)]


def _video(shape, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def models():
    """(diffusers model, its state dict) per layout: z_dim 8, and the real latent channels (48 / 16)."""
    vaes = {"wan22": make_wan22_vae(seed=5), "wan21": make_wan21_vae(seed=5),
            "wan22-z48": make_wan22_vae(seed=6, z_dim=48), "wan21-z16": make_wan21_vae(seed=6, z_dim=16)}
    return {name: (vae, {k: v.detach().clone() for k, v in vae.state_dict().items()}) for name, vae in vaes.items()}


@pytest.fixture(scope="module")
def oracles(models):
    """Each diffusers model cast once per dtype (a cast is in place, so each gets its own copy)."""
    return {(name, d): copy.deepcopy(vae).to(dtype) for name, (vae, _) in models.items() for d, dtype in DTYPES.items()}


def _diffusers_encode(vae, x, dtype, slicing=False) -> torch.Tensor:
    """The oracle: `vae.encode(x.to(dtype)).latent_dist.parameters` (vae already cast to dtype)."""
    if slicing:
        vae.enable_slicing()
    try:
        with torch.no_grad():
            return vae.encode(x.to(dtype)).latent_dist.parameters
    finally:
        vae.disable_slicing()


def _assert_equal(ours, theirs):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, theirs.dtype, ours.shape,
                                                                       theirs.shape)
    assert torch.equal(ours, theirs), f"max |reference - diffusers| = {(ours.float() - theirs.float()).abs().max()}"


# --- bit-exactness ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype_name, frames, batch, size", MATRIX,
                         ids=[f"{l}-{d}-F{f}-B{b}-{h}x{w}" for l, d, f, b, (h, w) in MATRIX])
def test_encode_is_bit_exact_with_diffusers(models, oracles, layout, dtype_name, frames, batch, size):
    dtype = DTYPES[dtype_name]
    state_dict = models[layout][1]
    x = _video((batch, 3, frames, *size), seed=MATRIX.index((layout, dtype_name, frames, batch, size)))

    moments = reference.encode(x, state_dict, dtype)

    _assert_equal(moments, _diffusers_encode(oracles[layout, dtype_name], x, dtype))
    assert moments.shape == encoded_shape(infer_encoder_config(state_dict), x.shape)
    if batch > 1:
        # diffusers' slicing encodes each sample alone: the reference does the same sample by sample.
        alone = torch.cat([reference.encode(x[i : i + 1], state_dict, dtype) for i in range(batch)])
        _assert_equal(alone, _diffusers_encode(oracles[layout, dtype_name], x, dtype, slicing=True))


@pytest.mark.parametrize("layout, dtype_name", [("wan22-z48", "fp32"), ("wan22-z48", "bf16"), ("wan21-z16", "fp32"),
                                                ("wan21-z16", "bf16")])
def test_the_real_latent_channels_at_narrow_widths(models, oracles, layout, dtype_name):
    dtype = DTYPES[dtype_name]
    x = _video((1, 3, 5, 32, 16), seed=7)
    moments = reference.encode(x, models[layout][1], dtype)
    assert moments.shape[1] == 2 * (48 if layout == "wan22-z48" else 16)
    _assert_equal(moments, _diffusers_encode(oracles[layout, dtype_name], x, dtype))


def test_the_moments_are_not_clamped(models, oracles):
    """diffusers' distribution clamps the log-variance to [-30, 20]; its `parameters`, the reference's output, are
    the moments before that."""
    loud = dict(models["wan21"][1])
    bias = loud["quant_conv.bias"].clone()
    bias[bias.shape[0] // 2 :] += 60.0  # the log-variance half
    loud["quant_conv.bias"] = bias
    x = _video((1, 3, 5, 16, 16), seed=8)
    moments = reference.encode(x, loud)
    assert moments[:, moments.shape[1] // 2 :].min() > 20.0
    vae = copy.deepcopy(oracles["wan21", "fp32"])
    vae.load_state_dict(loud)
    _assert_equal(moments, _diffusers_encode(vae, x, torch.float32))


def test_an_encoder_only_state_dict_encodes_like_the_whole_one(models):
    whole = models["wan22"][1]
    encoder_only = {k: v for k, v in whole.items() if k.startswith(("encoder.", "quant_conv."))}
    x = _video((1, 3, 5, 16, 16), seed=9)
    assert torch.equal(reference.encode(x, encoder_only), reference.encode(x, whole))


def test_encode_leaves_its_inputs_untouched_and_turns_tf32_off_for_its_run(models):
    state_dict = models["wan21"][1]
    sd = {k: v.clone() for k, v in state_dict.items()}
    x = _video((1, 3, 5, 8, 8), seed=10)
    x_before = x.clone()
    seen = []

    class RecordTF32AtConvs(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.nn.functional.conv3d, torch.nn.functional.conv2d):
                seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32))
            return func(*args, **(kwargs or {}))

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with RecordTF32AtConvs():
            reference.encode(x, sd, torch.bfloat16)
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert len(seen) > 50 and set(seen) == {(False, False)}  # every conv, quant_conv included, without TF32
    assert torch.equal(x, x_before)
    assert all(torch.equal(sd[k], state_dict[k]) and sd[k].dtype == torch.float32 for k in sd)


# --- bad inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, video, message", [
    ("wan22", torch.zeros(1, 3, 1, 72, 64), "multiples of 16 for this encoder; got 72 x 64"),
    ("wan22", torch.zeros(1, 3, 1, 16, 24), "multiples of 16"),
    ("wan21", torch.zeros(1, 3, 1, 7, 16), "at least 8 for this encoder; got 7 x 16"),
    ("wan21", torch.zeros(1, 3, 0, 16, 16), "every dimension >= 1"),
    ("wan21", torch.zeros(1, 4, 1, 16, 16), "[B, 3, F, H, W]"),
    ("wan21", torch.zeros(3, 1, 16, 16), "[B, 3, F, H, W]"),
    ("wan21", torch.zeros(1, 3, 1, 16, 16, dtype=torch.uint8), "floating-point tensor; got torch.uint8"),
    ("wan21", [[0.0]], "must be a torch.Tensor; got list"),
])
def test_bad_videos_raise_one_line(models, layout, video, message):
    with pytest.raises(ValueError) as error:
        reference.encode(video, models[layout][1])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_unsupported_dtype_raises(models, dtype):
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        reference.encode(_video((1, 3, 1, 8, 8), seed=11), models["wan21"][1], dtype)


def test_a_state_dict_without_an_encoder_raises(models):
    decoder_only = {k: v for k, v in models["wan22"][1].items() if k.startswith(("decoder.", "post_quant_conv."))}
    with pytest.raises(ValueError, match="no 'encoder.conv_in.weight'"):
        reference.encode(_video((1, 3, 1, 16, 16), seed=12), decoder_only)
    broken = dict(models["wan22"][1])
    del broken["encoder.mid_block.attentions.0.proj.bias"]
    with pytest.raises(ValueError, match="missing 'encoder.mid_block.attentions.0.proj.bias'"):
        reference.encode(_video((1, 3, 1, 16, 16), seed=12), broken)
