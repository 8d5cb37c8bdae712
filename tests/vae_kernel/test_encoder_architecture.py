"""The encoder's architecture (`vae_kernel.definitions.architecture`: `WanEncoderConfig`, `infer_encoder_config`,
`expected_encoder_shapes`, `encoded_shape`, `check_video`) against diffusers' own `AutoencoderKLWan`: the real-size
models of both layouts built on the meta device, narrow ones with seeded random weights, and what diffusers' encode
itself accepts and returns."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample, WanResidualBlock

from _vae_helpers import make_wan21_vae, make_wan22_vae
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import (
    WAN21_CONFIG, WAN21_ENCODER_CONFIG, WAN22_CONFIG, WAN22_ENCODER_CONFIG, check_video, diffusers_encoder_arguments,
    encoded_shape, encoder_state_dict, expected_encoder_shapes, infer_config, infer_encoder_config, narrow,
    narrow_encoder)

LAYOUTS = {"wan22": WAN22_ENCODER_CONFIG, "wan21": WAN21_ENCODER_CONFIG}


def _meta_vae(**arguments) -> AutoencoderKLWan:
    with torch.device("meta"):
        return AutoencoderKLWan(**arguments)


def _encoder_tensors(vae) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in vae.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}


@pytest.fixture(scope="module")
def narrow_vaes():
    """Seeded narrow diffusers models of both layouts (encoder 8 wide, z_dim 8)."""
    return {"wan22": make_wan22_vae(seed=3, base_dim=8, decoder_base_dim=16), "wan21": make_wan21_vae(seed=3)}


# --- the real models ---------------------------------------------------------------------------------------------


def test_the_real_encoders_are_read_from_diffusers_real_size_models():
    """Wan2.2 TI2V-5B's arguments (its encoder 160 wide, its decoder 256) and diffusers' defaults (Wan2.1)."""
    ti2v = _meta_vae(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2, in_channels=12,
                     out_channels=12)
    wan21 = _meta_vae()
    for vae, config, decoder in ((ti2v, WAN22_ENCODER_CONFIG, WAN22_CONFIG), (wan21, WAN21_ENCODER_CONFIG,
                                                                             WAN21_CONFIG)):
        state_dict = vae.state_dict()
        assert infer_encoder_config(state_dict) == config
        assert infer_config(state_dict) == decoder  # the decoder's own width, beside the encoder's
        assert expected_encoder_shapes(config) == _encoder_tensors(vae)  # every tensor, every shape, nothing more
        assert set(encoder_state_dict(state_dict)) == set(_encoder_tensors(vae))
    assert WAN22_ENCODER_CONFIG.dims == [160, 160, 320, 640, 640]
    assert WAN21_ENCODER_CONFIG.dims == [96, 96, 192, 384, 384]
    assert (WAN22_ENCODER_CONFIG.spatial_scale, WAN21_ENCODER_CONFIG.spatial_scale) == (16, 8)
    assert WAN22_ENCODER_CONFIG.levels == 4 and WAN22_ENCODER_CONFIG.level_widths(1) == (160, 320)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("base_dim, decoder_base_dim, z_dim", [(8, 8, None), (16, 24, None), (8, 12, "real")])
def test_narrow_encoders_and_another_decoder_width(layout, base_dim, decoder_base_dim, z_dim):
    """A narrow encoder of either layout, its decoder another width, z_dim narrow or the real one (48 / 16)."""
    real = LAYOUTS[layout]
    config = narrow_encoder(real, base_dim, z_dim=None if z_dim == "real" else 8)
    arguments = diffusers_encoder_arguments(config, decoder_base_dim)
    assert arguments["base_dim"] == base_dim and arguments["decoder_base_dim"] == decoder_base_dim
    vae = _meta_vae(**arguments)
    assert infer_encoder_config(vae.state_dict()) == config
    assert expected_encoder_shapes(config) == _encoder_tensors(vae)
    decoder = infer_config(vae.state_dict())
    assert decoder == narrow(WAN22_CONFIG if real.residual else WAN21_CONFIG, decoder_base_dim, z_dim=config.z_dim)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_names_are_diffusers_modules(layout, narrow_vaes):
    """`resnet(i, j)` names a residual block and `downsampler(i)` a downsample, in time where the config says so."""
    vae = narrow_vaes[layout]
    config = infer_encoder_config(vae.state_dict())
    for i in range(config.levels):
        cin, cout = config.level_widths(i)
        for j in range(config.num_res_blocks):
            block = vae.get_submodule(config.resnet(i, j))
            assert isinstance(block, WanResidualBlock)
            assert (block.in_dim, block.out_dim) == ((cin if j == 0 else cout), cout)
        if i < config.levels - 1:
            downsample = vae.get_submodule(config.downsampler(i))
            assert isinstance(downsample, WanResample) and downsample.dim == cout
            assert downsample.mode == ("downsample3d" if config.temperal_downsample[i] else "downsample2d")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_shapes_are_listed_in_execution_order(layout, narrow_vaes):
    """The modules with weights in the order diffusers' encode calls them in a pass with history (the first pass
    skips the time convs), then quant_conv; a residual block's 1x1 shortcut, which diffusers runs first, is listed
    last in its block."""
    vae = narrow_vaes[layout]
    calls: list[str] = []
    handles = [module.register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
               for name, module in vae.named_modules() if list(module.parameters(recurse=False))]
    try:
        with torch.no_grad():
            vae.encode(torch.zeros(1, 3, 5, 32, 32))
    finally:
        for handle in handles:
            handle.remove()
    second = calls.index("encoder.conv_in", 1)
    called = list(dict.fromkeys(calls[second:]))
    config = infer_encoder_config(vae.state_dict())
    listed = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in expected_encoder_shapes(config)))
    assert set(called) == set(listed)

    def without_shortcuts(names):
        return [n for n in names if not n.endswith("conv_shortcut")]

    assert without_shortcuts(called) == without_shortcuts(listed)
    shortcuts = [n for n in listed if n.endswith("conv_shortcut")]
    assert shortcuts and all(listed.index(n) == listed.index(n.replace("conv_shortcut", "conv2")) + 1
                             for n in shortcuts)


# --- shapes and sizes against diffusers' encode ------------------------------------------------------------------


@pytest.mark.parametrize("layout, shape", [
    ("wan22", (1, 3, 1, 16, 32)), ("wan22", (2, 3, 6, 32, 48)), ("wan22", (1, 3, 9, 48, 16)),
    ("wan21", (1, 3, 1, 8, 8)), ("wan21", (2, 3, 5, 17, 23)), ("wan21", (1, 3, 8, 31, 9)),
])
def test_encoded_shape_is_what_diffusers_returns(layout, shape, narrow_vaes):
    vae = narrow_vaes[layout]
    config = infer_encoder_config(vae.state_dict())
    with torch.no_grad():
        moments = vae.encode(torch.zeros(shape)).latent_dist.parameters
    assert tuple(moments.shape) == encoded_shape(config, shape)


def _diffusers_encodes(vae, h: int, w: int) -> bool:
    try:
        with torch.no_grad():
            vae.encode(torch.zeros(1, 3, 1, h, w))
    except (RuntimeError, ValueError):
        return False
    return True


def _check_passes(config, h: int, w: int) -> bool:
    try:
        check_video(torch.zeros(1, 3, 1, h, w), config)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("layout, sizes", [
    ("wan21", [(h, 9) for h in range(1, 18)] + [(9, w) for w in (5, 7, 8, 13)]),
    ("wan22", [(h, 16) for h in (2, 8, 14, 16, 18, 24, 30, 32, 40, 48)] + [(16, w) for w in (8, 24, 34, 64)]),
])
def test_check_video_takes_exactly_the_sizes_diffusers_encodes(layout, sizes, narrow_vaes):
    vae = narrow_vaes[layout]
    config = infer_encoder_config(vae.state_dict())
    verdicts = {(h, w): (_check_passes(config, h, w), _diffusers_encodes(vae, h, w)) for h, w in sizes}
    assert all(ours == theirs for ours, theirs in verdicts.values()), verdicts
    assert any(ours for ours, _ in verdicts.values()) and not all(ours for ours, _ in verdicts.values())


# --- bad weights and bad videos ----------------------------------------------------------------------------------


def _changed(state_dict, drop=(), add=None, reshape=None):
    sd = {k: v for k, v in state_dict.items() if k not in drop}
    sd.update(add or {})
    for name, shape in (reshape or {}).items():
        sd[name] = torch.zeros(shape)
    return sd


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_weights_raise_one_line_naming_the_tensor(layout, narrow_vaes):
    sd = narrow_vaes[layout].state_dict()
    c = infer_encoder_config(sd)
    conv2 = f"{c.resnet(1, 0)}.conv2.bias"
    time_conv = f"{c.downsampler(1)}.time_conv.weight"
    cases = [
        (_changed(sd, drop=[conv2]), f"missing '{conv2}'"),
        (_changed(sd, drop=[time_conv]), f"missing '{time_conv}'"),  # its bias alone does not make a time conv
        (_changed(sd, drop=["quant_conv.weight"]), "missing 'quant_conv.weight'"),
        (_changed(sd, reshape={conv2: (5,)}), f"'{conv2}'] has shape [5]"),
        (_changed(sd, reshape={"encoder.mid_block.attentions.0.norm.gamma": (3, 1, 1)}),
         "'encoder.mid_block.attentions.0.norm.gamma'] has shape [3, 1, 1]"),
        (_changed(sd, add={f"{c.resnet(0, 0)}.extra.weight": torch.zeros(1)}), "does not use"),
        (_changed(sd, drop=[k for k in sd if k.startswith("encoder.")]), "no 'encoder.conv_in.weight'"),
        (_changed(sd, reshape={"encoder.conv_in.weight": (8, 3, 3, 3)}), "must be 5-D"),
        (_changed(sd, reshape={"encoder.conv_in.weight": (8, 5, 3, 3, 3)}), "5 input channels"),
        (_changed(sd, reshape={"encoder.conv_out.weight": (15, 32, 3, 3, 3)}), "15 output channels"),
        (_changed(sd, reshape={f"{c.resnet(2, 0)}.conv1.weight": (20, 16, 3, 3, 3)}), "not multiples"),
        (_changed(sd, add={"encoder.down_blocks.x.conv1.weight": torch.zeros(1)}), "'encoder.down_blocks.x"),
        (_changed(sd, drop=[k for k in sd if k.startswith(f"{c.downsampler(1)}.time_conv.")]),
         "in time at 1 level"),
        ([1, 2], "must be a dict"),
        ({**sd, "encoder.conv_out.bias": [0.0]}, "'encoder.conv_out.bias'] must be a tensor"),
    ]
    for state_dict, message in cases:
        with pytest.raises(ValueError) as error:
            infer_encoder_config(state_dict)
        assert message in str(error.value) and "\n" not in str(error.value), (message, str(error.value))


@pytest.mark.parametrize("video, config, message", [
    ([[0.0]], WAN21_ENCODER_CONFIG, "must be a torch.Tensor"),
    (torch.zeros(1, 3, 16, 16), WAN21_ENCODER_CONFIG, "[B, 3, F, H, W]"),
    (torch.zeros(1, 4, 1, 16, 16), WAN21_ENCODER_CONFIG, "[B, 3, F, H, W]"),
    (torch.zeros(1, 3, 0, 16, 16), WAN21_ENCODER_CONFIG, "every dimension >= 1"),
    (torch.zeros(0, 3, 1, 16, 16), WAN21_ENCODER_CONFIG, "every dimension >= 1"),
    (torch.zeros(1, 3, 1, 16, 16, dtype=torch.int64), WAN21_ENCODER_CONFIG, "floating-point"),
    (torch.zeros(1, 3, 1, 7, 16), WAN21_ENCODER_CONFIG, "at least 8 for this encoder; got 7 x 16"),
    (torch.zeros(1, 3, 1, 72, 64), WAN22_ENCODER_CONFIG, "multiples of 16 for this encoder; got 72 x 64"),
    (torch.zeros(1, 3, 1, 64, 8), WAN22_ENCODER_CONFIG, "multiples of 16"),
])
def test_bad_videos_raise_one_line(video, config, message):
    with pytest.raises(ValueError) as error:
        check_video(video, config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_good_videos_pass():
    check_video(torch.zeros(2, 3, 6, 17, 23), WAN21_ENCODER_CONFIG)
    check_video(torch.zeros(1, 3, 1, 32, 48, dtype=torch.bfloat16), WAN22_ENCODER_CONFIG)
