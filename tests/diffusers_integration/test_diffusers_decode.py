"""`enable_fast_decode` on diffusers' own AutoencoderKLWan (docs/design/diffusers-integration.md, "The fast decoder and
encoder in diffusers"): return types, dtypes, the allowance against diffusers' fp32 decode, the decoder built once and
rebuilt when the weights change, autograd through diffusers' decode, slicing and exact tiling, the option checks, and
what diffusers' own AutoencoderKLWan tests check (output shapes, save/load round trip, determinism, slicing and tiling,
training through `forward`, dtypes) with the fast decoder enabled on every model they build."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from _diffusers_pipelines import tiny_vae
from _source_tree import REPO
from _vae_helpers import make_wan21_vae, make_wan22_vae, randomize_parameters_
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DecoderOutput

from fastvideo_pan2_ext import disable_fast_decode, enable_fast_decode
from fastvideo_pan2_ext.diffusers_integration.fast_decode import is_fast_decode_enabled
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32


def _latents(vae, b=1, t=3, h=4, w=6, seed=0):
    return torch.randn(b, vae.config.z_dim, t, h, w, generator=torch.Generator().manual_seed(seed))


def _diffusers(vae, z, **kwargs) -> torch.Tensor:
    with torch.no_grad(), exact_fp32():
        return type(vae).decode(vae, z, **kwargs).sample


def _fast(vae, z, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z, **kwargs).sample


def _decoder(vae) -> WanVAEDecoder:
    return vae.__dict__["_pan2_fast_decode"].worker


def _spy(decoder: WanVAEDecoder) -> list:
    """Record the (latent shape, plan) of every decode the fast decoder runs (the real decode still runs)."""
    calls, decode = [], decoder.decode

    def recording(z):
        video = decode(z)
        calls.append((tuple(z.shape), decoder.last_plan))
        return video

    decoder.decode = recording
    return calls


# Every VAE config below is one diffusers accepts: its own test models (Wan2.1 base 3 x [1, 1, 1, 1], one res block;
# the Wan2.2 5B test model with 48 latent channels), the narrow real layouts, odd widths, patch-free residual.
CONFIGS = {
    "diffusers-test-wan2.1": lambda: tiny_vae("wan2.1"),
    "diffusers-test-wan2.2": lambda: tiny_vae("wan2.2-ti2v"),
    "wan2.2-narrow": make_wan22_vae,
    "wan2.1-narrow": make_wan21_vae,
    "wan2.1-odd-widths": lambda: randomize_parameters_(AutoencoderKLWan(base_dim=5, z_dim=7, dim_mult=[1, 3, 2, 2],
                                                                        num_res_blocks=1), 3).eval(),
    "residual-no-patch": lambda: randomize_parameters_(AutoencoderKLWan(base_dim=4, z_dim=6, is_residual=True,
                                                                        dim_mult=[1, 2, 2, 2],
                                                                        num_res_blocks=2), 4).eval(),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_decodes_within_the_allowance_of_diffusers_fp32(name):
    vae = CONFIGS[name]()
    z = _latents(vae, b=2, t=3, h=3, w=5)  # batch > 1, odd sizes
    reference = _diffusers(vae, z)
    baseline = _diffusers(copy.deepcopy(vae).to(torch.bfloat16), z.bfloat16()).float()
    enable_fast_decode(vae)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decoded by us: no fallback warning
        with torch.no_grad():
            out = vae.decode(z)
    assert isinstance(out, DecoderOutput) and out.sample.dtype == torch.float32
    assert _decoder(vae) is not None and _decoder(vae).last_plan is not None  # the fast decoder ran
    report = compare_to_reference(name, out.sample, reference, baseline, unit_range=True)
    assert report.ok, str(report)


def test_the_fast_path_is_the_fast_decoder_and_disable_restores_diffusers_bit_for_bit():
    vae = make_wan22_vae()
    z = _latents(vae)
    before = _diffusers(vae, z)
    enable_fast_decode(vae, frames_per_pass=2)
    assert is_fast_decode_enabled(vae)
    fast = _fast(vae, z)
    direct = WanVAEDecoder(vae, device="cpu", local=True, frames_per_pass=2).decode(z)
    assert torch.equal(fast, direct.float())
    assert not torch.equal(fast, before)  # bf16 arithmetic: a different video, within the allowance
    disable_fast_decode(vae)
    assert not is_fast_decode_enabled(vae) and "decode" not in vae.__dict__
    with torch.no_grad(), exact_fp32():
        assert torch.equal(vae.decode(z).sample, before)
    disable_fast_decode(vae)  # twice: nothing to do


def test_return_types_and_dtypes_are_diffusers():
    vae = make_wan21_vae()
    z = _latents(vae)
    enable_fast_decode(vae)
    with torch.no_grad():
        as_tuple = vae.decode(z, return_dict=False)
        positional = vae.decode(z, False)
    assert type(as_tuple) is tuple and len(as_tuple) == 1 and torch.equal(as_tuple[0], positional[0])
    for dtype in (torch.bfloat16, torch.float16):
        vae.to(dtype)
        reference = _diffusers(vae, z.to(dtype))
        out = _fast(vae, z.to(dtype))
        assert out.dtype == dtype == reference.dtype and out.shape == reference.shape and out.device == z.device


def test_one_decoder_per_vae_whose_weights_follow_every_change():
    vae = make_wan22_vae(seed=0)
    z = _latents(vae)
    enable_fast_decode(vae)
    first = _fast(vae, z)
    decoder = _decoder(vae)
    assert torch.equal(_fast(vae, z), first) and _decoder(vae) is decoder  # made once (and deterministic)
    vae.load_state_dict(make_wan22_vae(seed=5).state_dict())  # in place: same tensors, new values
    changed = _fast(vae, z)
    assert _decoder(vae) is decoder
    assert torch.equal(changed, WanVAEDecoder(make_wan22_vae(seed=5), device="cpu", local=True).decode(z).float())
    with torch.no_grad():
        next(vae.decoder.conv_out.parameters()).mul_(0.5)  # one in-place edit of one tensor
    assert not torch.equal(_fast(vae, z), changed)
    vae.to(torch.bfloat16)  # cast: replaced storage
    assert _fast(vae, z.bfloat16()).dtype == torch.bfloat16 and _decoder(vae) is decoder


def test_enabling_twice_replaces_the_options():
    vae = make_wan21_vae()
    z = _latents(vae, t=4)
    enable_fast_decode(vae, frames_per_pass=1)
    _fast(vae, z)
    assert _decoder(vae).last_plan.frames_per_pass == 1
    enable_fast_decode(vae, frames_per_pass=2, tile_rows=2)
    _fast(vae, z)
    assert _decoder(vae).last_plan == (2, 2)


def test_autograd_goes_through_diffusers_decode_and_gradients_flow():
    vae = make_wan21_vae()
    z = _latents(vae).requires_grad_(True)
    enable_fast_decode(vae)
    with pytest.warns(UserWarning, match="autograd is recording"):
        out = vae.decode(z).sample
    with exact_fp32():
        expected = type(vae).decode(vae, z.detach()).sample
    assert out.grad_fn is not None and torch.equal(out.detach(), expected)
    out.square().mean().backward()
    assert z.grad is not None and vae.decoder.conv_out.weight.grad is not None
    vae.requires_grad_(False)
    assert _fast(vae, z.detach()).grad_fn is None and _decoder(vae) is not None  # inference: the fast decoder


def test_a_training_step_through_forward_updates_the_decoder():
    """diffusers' training check: forward() (encode + decode) in train mode, a loss, backward, every decoder weight
    gets a gradient."""
    vae = tiny_vae("wan2.1").train()
    enable_fast_decode(vae)
    sample = torch.randn(2, 3, 9, 16, 16, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="autograd"):
        out = vae(sample).sample
    assert out.shape == sample.shape
    torch.nn.functional.mse_loss(out, torch.zeros_like(out)).backward()
    assert all(p.grad is not None for p in vae.decoder.parameters())


def test_forward_without_grad_decodes_with_the_fast_decoder():
    """diffusers' output-shape check through forward(): the posterior mode decoded by the fast decoder."""
    vae = tiny_vae("wan2.1")
    sample = torch.randn(2, 3, 9, 16, 16, generator=torch.Generator().manual_seed(0))
    enable_fast_decode(vae)
    with torch.no_grad():
        out = vae(sample, return_dict=False)
        z = vae.encode(sample).latent_dist.mode()
    assert type(out) is tuple and out[0].shape == sample.shape
    assert torch.equal(out[0], _fast(vae, z))


def test_slicing_decodes_the_batch_one_element_after_another():
    vae = make_wan22_vae()
    z = _latents(vae, b=3)
    enable_fast_decode(vae)
    whole = _fast(vae, z)
    calls = _spy(_decoder(vae))
    vae.enable_slicing()
    sliced = _fast(vae, z)
    assert [shape[0] for shape, _ in calls] == [1, 1, 1]
    report = compare_to_reference("sliced", sliced, whole, whole, unit_range=True)
    assert report.max_err < 1e-2, str(report)  # the same ops per element (batch size may change rounding)
    vae.disable_slicing()
    assert torch.equal(_fast(vae, z), whole)


@pytest.mark.slow
def test_enable_tiling_gives_exact_tiles_sized_from_diffusers_tile_height():
    vae = make_wan21_vae()  # 8x spatial, as its config says
    z = _latents(vae, t=3, h=9, w=7)
    enable_fast_decode(vae)
    untiled = _fast(vae, z)
    calls = _spy(_decoder(vae))
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                      tile_sample_stride_width=16)
    tiled = _fast(vae, z)
    assert calls[-1][1].tile_rows == 32 // 8
    assert torch.equal(tiled, untiled)  # exact tiles: no seams
    # diffusers' own blended tiles at the same settings are not the untiled video (the seams this removes).
    disable_fast_decode(vae)
    blended = _diffusers(vae, z)
    vae.disable_tiling()
    assert (blended - _diffusers(vae, z)).abs().max() > 1e-3
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                      tile_sample_stride_width=16)
    enable_fast_decode(vae, max_memory="1GiB")  # the options' budget applies whatever diffusers' switch says
    _fast(vae, z)
    assert _decoder(vae).max_memory == 1 << 30


def test_small_latents_under_enable_tiling_are_not_tiled():
    """diffusers tiles only latents larger than its tile; so does the fast decoder."""
    vae = make_wan21_vae()
    z = _latents(vae, h=4, w=4)
    enable_fast_decode(vae)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)
    _fast(vae, z)
    assert _decoder(vae).last_plan.tile_rows is None


def test_save_load_round_trip_and_determinism(tmp_path):
    vae = tiny_vae("wan2.2-ti2v")
    z = _latents(vae, b=2, h=2, w=2)
    enable_fast_decode(vae)
    first = _fast(vae, z)
    assert torch.equal(_fast(vae, z), first)  # deterministic
    vae.save_pretrained(tmp_path)
    loaded = AutoencoderKLWan.from_pretrained(tmp_path).eval()
    assert not is_fast_decode_enabled(loaded)  # the switch is not saved with the weights
    enable_fast_decode(loaded)
    assert torch.equal(_fast(loaded, z), first)


def test_a_vae_outside_the_architecture_falls_back_to_diffusers_with_one_warning():
    # One temporal upsampling level: diffusers builds it; the fast decoder implements Wan's 4x in time only.
    vae = randomize_parameters_(AutoencoderKLWan(base_dim=4, z_dim=4, temperal_downsample=[False, False, True]), 1)
    z = _latents(vae)
    expected = _diffusers(vae.eval(), z)
    enable_fast_decode(vae)
    with pytest.warns(UserWarning, match="outside the fast decoder's architecture.*upsamples in time"):
        with exact_fp32():
            first = _fast(vae, z)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with exact_fp32():
            second = _fast(vae, z)
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_latents_the_decoder_refuses_raise_a_clear_error():
    vae = make_wan21_vae()
    enable_fast_decode(vae)
    bad = _latents(vae)
    bad[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        _fast(vae, bad)
    with pytest.raises(ValueError, match=r"latents must be \[B, 8"):
        _fast(vae, torch.zeros(1, 5, 2, 2, 2))


@pytest.mark.parametrize("options, message", [
    ({"frames_per_pass": 0}, "frames_per_pass must be 'auto' or an int >= 1"),
    ({"tile_rows": 2, "max_memory": "1GiB"}, "set tile_rows or max_memory, not both"),
    ({"max_memory": "lots"}, "max_memory"),
    ({"backend": "tpu"}, "backend must be one of"),
    ({"conv_algorithm": "fft"}, "conv_algorithm must be one of"),
])
def test_bad_options_are_refused_at_the_call(options, message):
    vae = make_wan21_vae()
    with pytest.raises(ValueError, match=message):
        enable_fast_decode(vae, **options)
    assert not is_fast_decode_enabled(vae)


def test_a_group_where_torch_distributed_is_not_initialized_is_refused_at_the_call():
    """Both switches, in a process of its own: a process of this test run may hold a default group an earlier test
    made."""
    code = ("import sys; sys.path.insert(0, 'tests')\n"
            "import torch.distributed as dist\n"
            "from _vae_helpers import make_wan21_vae\n"
            "import fastvideo_pan2_ext as p\n"
            "assert not dist.is_initialized()\n"
            "for switch, enabled in ((p.enable_fast_decode, p.is_fast_decode_enabled),\n"
            "                        (p.enable_fast_encode, p.is_fast_encode_enabled)):\n"
            "    vae = make_wan21_vae()\n"
            "    try:\n"
            "        switch(vae, pg=object())\n"
            "    except ValueError as exc:\n"
            "        print(exc, enabled(vae))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    line = "pg was given but torch.distributed is not initialized (call init_process_group first) False"
    assert done.stdout.splitlines() == [line, line], done.stdout


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="AutoencoderKLWan or a pipeline whose .vae is one; got Linear"):
        enable_fast_decode(torch.nn.Linear(1, 1))

    class Pipe:
        vae = torch.nn.Linear(1, 1)

    with pytest.raises(ValueError, match="Pipe whose .vae is Linear"):
        disable_fast_decode(Pipe())
    with pytest.raises(ValueError, match=r"unknown decoder option\(s\) frames; the options are frames_per_pass"):
        enable_fast_decode(make_wan21_vae(), frames=2)


@pytest.mark.slow
def test_importing_the_entry_points_does_not_import_fastvideo():
    code = ("import sys, fastvideo_pan2_ext as p; p.enable_fast_decode; p.disable_fast_decode; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fastvideo'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_diffusers_room_imports_only_the_decoder_library():
    from _import_graph import NAME, _graph

    graph = _graph()
    room = f"{NAME}.diffusers_integration"
    for module in ("route", "fast_decode", "fast_encode"):
        targets = graph[f"{room}.{module}"] - {f"{room}.route"}  # the routing both switches share
        assert targets and all(t.startswith(f"{NAME}.vae_kernel") for t in targets), (module, targets)
