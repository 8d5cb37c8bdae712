"""The fast encoder in FastVideo (`fastvideo_integration.fast_encode`, docs/design/fastvideo-integration.md "The fast
encoder in FastVideo"):

- FastVideo's own `AutoencoderKLWan` (built tiny from its `WanVAEConfig`, both layouts, seeded random weights):
  `encode_kernel` off returns FastVideo's encode exactly; on, FastVideo's `DiagonalGaussianDistribution` of moments
  within fp32 rounding of it (mean and logvar separately), whose `.sample(generator)` draws what FastVideo's draws;
  its options reach the encoder; it follows the VAE's weights and place (docs/design/worker.md, "One worker core");
- every case the fast encoder cannot serve runs FastVideo's own encode, with one warning line;
- PAN2's `vae_encode_*` switches (views of `vae_config.encode_*`), checked before any model loads: in the CLI every
  encoder and decoder mistake (a value, a misspelt name, `backend cuda` without a GPU, a `max_memory` the request
  cannot fit, planned as the workers plan it) is one line naming the flag as typed;
- end to end, `fastvideo generate --pipeline pan2` on the tiny checkpoint with the switch on and off (two real runs,
  parent and worker: ~1 min on 2 cores): the same video within a tight bound.
"""

from __future__ import annotations

import logging
import re
import sys

import fastvideo.logger  # noqa: F401 - its import configures logging (the root's handlers, caplog's among them)
import pytest
import torch
from _pan2_helpers import E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, decode_hook_env, exif_rotated_jpeg, run
from _vae_helpers import fastvideo_wan_vae_of, make_wan21_vae, make_wan22_vae, randomize_parameters_

# fp32 rounding between two fp32 encodes of moments of magnitude ~1 at these widths (measured ~2e-6).
FP32_ATOL = 3e-5
LOGGER = "fastvideo_pan2_ext.fastvideo_integration.fast_encode"
# (layout, height, width): Wan2.2 takes multiples of 16; Wan2.1 any size from 8 (here not a multiple of 8).
LAYOUTS = {"wan2.2": (make_wan22_vae, 32, 48), "wan2.1": (make_wan21_vae, 20, 28)}


def _fastvideo_encode(vae, x):
    """FastVideo's own encode, under the plugin's route."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    return AutoencoderKLWan.encode.__wrapped__(vae, x)


def _video(shape, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _i2v_input(batch: int, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """An image-to-video conditioning input as FastVideo's ImageVAEEncodingStage builds it: the image, then zeros."""
    image = _video((batch, 3, 1, height, width), seed)
    return torch.cat([image, image.new_zeros(batch, 3, frames - 1, height, width)], dim=2)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    """(FastVideo's Wan VAE of the layout, switch off, fp32, grads off as FastVideo's inference has them; height;
    width)."""
    make, height, width = LAYOUTS[request.param]
    vae = fastvideo_wan_vae_of(make(seed=3)).requires_grad_(False)
    return vae, height, width


@pytest.fixture
def switched_on(layout):
    """The layout's VAE with `encode_kernel` on (and its options at their defaults) inside the test."""
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    vae = layout[0]
    vae.config.encode_kernel = True
    try:
        yield layout
    finally:
        vae.config.encode_kernel = False
        for name, (_, default) in fast_encode.CONFIG_FIELDS.items():
            if name != fast_encode.SWITCH:
                setattr(vae.config, name, default)


def _assert_within_fp32_rounding(ours, fastvideos) -> None:
    for part in ("mean", "logvar"):
        a, b = getattr(ours, part), getattr(fastvideos, part)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, part
        torch.testing.assert_close(a, b, rtol=0, atol=FP32_ATOL, msg=part)


# --------------------------------------------------------------------------------------------------- off and on


def test_switch_off_is_fastvideos_own_encode(layout):
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    vae, height, width = layout
    x = _video((1, 3, 9, height, width), seed=1)
    assert vae.config.encode_kernel is False
    with torch.no_grad():
        off, fastvideo = vae.encode(x), _fastvideo_encode(vae, x)
    assert type(off) is type(fastvideo) and type(off).__module__ == "fastvideo.models.vaes.common"
    assert torch.equal(off.parameters, fastvideo.parameters)
    assert vae not in fast_encode._encoders  # the fast encoder was never made


@pytest.mark.parametrize("case", ["first frame", "clip", "i2v batch 2"])
def test_switch_on_is_fastvideos_distribution_within_rounding_and_draws_the_same(switched_on, case):
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    vae, height, width = switched_on
    if case == "first frame":  # TI2V (PAN2): one frame
        x = _video((1, 3, 1, height, width), seed=2)
    elif case == "clip":  # video-to-video: 11 frames, of which the VAE encodes 9 (FastVideo drops the rest too)
        x = _video((1, 3, 11, height, width), seed=3)
    else:  # image-to-video conditioning, two clips (preprocessing): the zeros repeat, and the encoder reuses them
        vae.config.encode_frames_per_pass = 1
        x = _i2v_input(2, 25, height, width, seed=4)
    with torch.no_grad():
        ours, fastvideo = vae.encode(x), _fastvideo_encode(vae, x)
    assert type(ours) is type(fastvideo)
    assert ours.parameters.dtype == torch.float32 and ours.parameters.device == x.device
    assert ours.mean.shape == fastvideo.mean.shape == (x.shape[0], vae.z_dim, 1 + (x.shape[2] - 1) // 4,
                                                       height // 16 if vae.config.patch_size else height // 8,
                                                       width // 16 if vae.config.patch_size else width // 8)
    _assert_within_fp32_rounding(ours, fastvideo)
    assert torch.equal(ours.mode(), ours.mean)
    # The same generator state draws the same noise: the samples differ only as the moments do.
    ours_gen, fastvideo_gen = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    torch.testing.assert_close(ours.sample(ours_gen), fastvideo.sample(fastvideo_gen), rtol=0, atol=4 * FP32_ATOL)
    assert torch.equal(ours_gen.get_state(), fastvideo_gen.get_state())
    encoder = fast_encode._encoders[vae][1]  # the fast encoder served it
    assert encoder.last_plan is not None and encoder.device == x.device
    if case == "i2v batch 2":
        assert encoder.last_plan.frames_per_pass == 1 and any(encoder.last_reuse.values())


def test_the_options_reach_the_encoder(switched_on):
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    vae, height, width = switched_on
    x = _video((1, 3, 9, height, width), seed=5)
    with torch.no_grad():
        fastvideo = _fastvideo_encode(vae, x)
        vae.config.encode_frames_per_pass, vae.config.encode_tile_rows = 1, 1
        tiled = vae.encode(x)
        encoder = fast_encode._encoders[vae][1]
        assert (encoder.last_plan.frames_per_pass, encoder.last_plan.tile_rows) == (1, 1)
        vae.config.encode_precision = "bf16"
        bf16 = vae.encode(x)
    assert fast_encode._encoders[vae][1].dtype == torch.bfloat16
    _assert_within_fp32_rounding(tiled, fastvideo)
    assert bf16.parameters.dtype == torch.float32  # the VAE's dtype, whatever the arithmetic
    torch.testing.assert_close(bf16.mean, fastvideo.mean, rtol=0, atol=0.1)
    assert (bf16.mean - fastvideo.mean).abs().max() > 10 * FP32_ATOL  # bf16 arithmetic really ran


def test_a_bf16_vae_under_fastvideos_autocast_encodes_in_bf16_no_worse_than_fastvideo():
    """`vae_precision` bf16: FastVideo loads the VAE in bf16 and encodes under autocast(bf16); the fast encoder's
    "auto" precision computes in bf16 too, and its moments (bf16) are as close to the fp32 encode as FastVideo's."""
    vae = fastvideo_wan_vae_of(make_wan22_vae(seed=5)).requires_grad_(False)
    x = _i2v_input(1, 9, 32, 32, seed=6)
    with torch.no_grad():
        exact = _fastvideo_encode(vae, x)
        vae.to(torch.bfloat16)
        vae.config.encode_kernel = True
        with torch.autocast("cpu", torch.bfloat16):  # FastVideo's stages: autocast("cuda", bf16); here on the CPU
            ours, fastvideo = vae.encode(x), _fastvideo_encode(vae, x)
    assert ours.parameters.dtype == fastvideo.parameters.dtype == torch.bfloat16
    for part in ("mean", "logvar"):
        ours_error = (getattr(ours, part).float() - getattr(exact, part)).abs().max()
        fastvideo_error = (getattr(fastvideo, part).float() - getattr(exact, part)).abs().max()
        assert ours_error <= 2 * fastvideo_error + 1e-2, (part, ours_error, fastvideo_error)


# --------------------------------------------------------------------------------------------------- following the VAE


def test_a_weight_changed_between_encodes_is_used_and_the_encoder_follows_a_move(switched_on):
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    vae, height, width = switched_on
    x = _video((1, 3, 5, height, width), seed=7)
    saved = {name: t.clone() for name, t in vae.state_dict().items()}
    try:
        with torch.no_grad():
            vae.encode(x)
            encoder = fast_encode._encoders[vae][1]
            vae.encoder.conv_in.weight.data.mul_(1.5)  # a write no version counter records
            _assert_within_fp32_rounding(vae.encode(x), _fastvideo_encode(vae, x))
            assert fast_encode._encoders[vae][1] is encoder  # the same encoder, its weights re-read
            before = vae.encode(x).parameters
            vae.to("meta")  # the VAE leaves the encoder's device: its prepared weights leave too (the decoder's way)
            assert fast_encode._encoders[vae][1] is encoder and not encoder.weights
            vae.to_empty(device="cpu")
            vae.load_state_dict(saved)
            vae.encoder.conv_in.weight.data.mul_(1.5)  # as before the move
            assert torch.equal(vae.encode(x).parameters, before)  # the same encoder, its weights prepared again
            assert fast_encode._encoders[vae][1] is encoder and encoder.weights
    finally:
        vae.load_state_dict(saved)


# --------------------------------------------------------------------------------------------------- what it cannot serve


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def _served_by_fastvideo(vae, x, caplog, expected_warning: str):
    """`vae.encode(x)` twice: FastVideo's own result both times (or its own error), one warning line in all."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        results = []
        for _ in range(2):
            try:
                results.append(vae.encode(x).parameters)
            except Exception as exc:  # noqa: BLE001 - FastVideo's own error is its answer
                results.append(exc)
    try:
        fastvideo = _fastvideo_encode(vae, x).parameters
    except Exception as exc:  # noqa: BLE001
        assert [type(r) for r in results] == [type(exc)] * 2 and {str(r) for r in results} == {str(exc)}, results
    else:
        for r in results:
            assert isinstance(r, torch.Tensor), r
            torch.testing.assert_close(r, fastvideo, rtol=0, atol=0, equal_nan=True)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert expected_warning in warnings[0] and warnings[0].endswith("; encoding with FastVideo's own encode")


def _wan21_vae_of_config(**arch):
    from fastvideo.configs.models.vaes import WanVAEConfig
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    config = WanVAEConfig()
    config.update_model_arch({"base_dim": 8, "z_dim": 4, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4, **arch})
    config.encode_kernel = True
    return randomize_parameters_(AutoencoderKLWan(config), seed=6).eval().requires_grad_(False)


def test_use_feature_cache_off_is_fastvideos_tiled_path(caplog):
    vae = _wan21_vae_of_config()
    vae.use_feature_cache = False
    with torch.no_grad():
        _served_by_fastvideo(vae, _video((1, 3, 9, 16, 16), seed=8), caplog, "vae_config.use_feature_cache is False")


def test_a_layout_outside_the_wan_vae_is_fastvideos(caplog):
    """Attention blocks in the down path (`attn_scales`): FastVideo's encoder runs them; the fast encoder is the Wan
    VAE's, which has none."""
    vae = _wan21_vae_of_config(attn_scales=(1.0,))
    with torch.no_grad():
        _served_by_fastvideo(vae, _video((1, 3, 5, 16, 16), seed=9), caplog,
                             "the fast encoder cannot take this VAE's encoder weights (state_dict is missing")


def test_autograd_recording_is_fastvideos_and_gradients_flow(caplog):
    vae = _wan21_vae_of_config().requires_grad_(True)
    x = _video((1, 3, 5, 16, 16), seed=10)
    _served_by_fastvideo(vae, x, caplog, "autograd is recording through this encode")
    vae.encode(x).mean.sum().backward()
    assert vae.encoder.conv_in.weight.grad is not None and vae.encoder.conv_in.weight.grad.abs().sum() > 0


def test_a_weight_turned_non_finite_is_fastvideos_until_it_is_finite_again(caplog):
    """The encoder checks the weights' values as it takes them, once per encode: a weight made non-finite after the
    fast encoder was made runs FastVideo's encode (one warning); made finite again, it is the fast encoder's."""
    vae = _wan21_vae_of_config()
    x = _video((1, 3, 5, 16, 16), seed=14)
    from fastvideo_pan2_ext.fastvideo_integration import fast_encode

    weight = vae.encoder.down_blocks[1].conv2.weight
    with torch.no_grad():
        _assert_within_fp32_rounding(vae.encode(x), _fastvideo_encode(vae, x))
        encoder = fast_encode._encoders[vae][1]  # the fast encoder served it
        kept = weight.clone()
        weight[0, 0, 0, 0, 0] = float("nan")
        _served_by_fastvideo(vae, x, caplog, "the fast encoder cannot take this VAE's encoder weights "
                                             "(state_dict['encoder.down_blocks.1.conv2.weight'] has non-finite "
                                             "values)")
        weight.copy_(kept)
        encoder.last_plan = None
        _assert_within_fp32_rounding(vae.encode(x), _fastvideo_encode(vae, x))
        assert encoder.last_plan is not None  # the fast encoder served it again


def test_unmerged_lora_weights_are_fastvideos_until_merged(caplog):
    from peft import LoraConfig, inject_adapter_in_model

    vae = _wan21_vae_of_config()
    x = _video((1, 3, 5, 16, 16), seed=11)
    with torch.no_grad():
        plain = _fastvideo_encode(vae, x).parameters
        inject_adapter_in_model(LoraConfig(r=2, target_modules=r"encoder\.down_blocks\.2\.resample\.1",
                                           init_lora_weights=False), vae)
        vae.requires_grad_(False)
        assert not torch.equal(_fastvideo_encode(vae, x).parameters, plain)  # the adapter changes the encode
        _served_by_fastvideo(vae, x, caplog, "encoder.down_blocks.2.resample.1 has LoRA adapters that are active "
                                             "but not merged")
        vae.encoder.down_blocks[2].resample[1].merge()
        _assert_within_fp32_rounding(vae.encode(x), _fastvideo_encode(vae, x))  # merged: the fast encoder's


def test_a_video_size_the_encoder_does_not_take_is_fastvideos(caplog):
    vae = _wan21_vae_of_config()
    with torch.no_grad():  # 4 rows: fewer than the three downsamples' windows read (FastVideo fails its own way)
        _served_by_fastvideo(vae, _video((1, 3, 5, 4, 16), seed=12), caplog,
                             "video height and width must be at least 8 for this encoder; got 4 x 16")


# --------------------------------------------------------------------------------------------------- options


# The field as PAN2's config names it (vae_encode_...) or as FastVideo's VAE config does (vae_config.encode_...),
# whichever check FastVideo reaches first.
@pytest.mark.parametrize("field, value, message", [
    ("encode_precision", "fp64", r"encode_precision must be one of \['auto', 'fp32', 'bf16'\]; got 'fp64'$"),
    ("encode_frames_per_pass", 0, r"encode_frames_per_pass must be 'auto' or an int >= 1; got 0$"),
    ("encode_reuse_steady", "yes", r"encode_reuse_steady must be True or False; got 'yes'$"),
    ("encode_max_memory", "lots", r"encode_max_memory must be bytes"),
    ("encode_backend", "cuda", r"encode_backend='cuda' runs the compiled bf16 kernels, and this encode computes in "
                               r"fp32 \(vae_precision 'fp32', vae_(config\.)?encode_precision 'auto'\)"),  # fp32 VAE
], ids=["precision", "frames_per_pass", "reuse_steady", "max_memory", "compiled in fp32"])
def test_a_bad_option_is_one_error_when_fastvideos_args_are_made_before_any_model_loads(tiny_ckpt, monkeypatch, field,
                                                                                         value, message):
    from fastvideo import VideoGenerator
    from fastvideo.fastvideo_args import FastVideoArgs

    def no_workers(*args, **kwargs):
        raise AssertionError("FastVideo started its workers")

    monkeypatch.setattr(VideoGenerator, "from_fastvideo_args", classmethod(no_workers))
    message = r"^vae_(config\.)?" + message
    with pytest.raises(ValueError, match=message):
        FastVideoArgs.from_kwargs(model_path=str(tiny_ckpt), num_gpus=1,
                                  **{"vae_config.encode_kernel": True, f"vae_config.{field}": value})
    with pytest.raises(ValueError, match=message):
        VideoGenerator.from_config({"model_path": str(tiny_ckpt), "engine": {"num_gpus": 1}, "pipeline": {
            "experimental": {"pipeline_config": {"vae_config": {"encode_kernel": True, field: value}}}}})


def test_pan2_switches_are_views_of_the_vae_config_and_checked():
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    config = PAN2PipelineConfig(vae_encode_kernel=True, vae_encode_tile_rows=2, vae_encode_precision="fp32")
    vae_config = config.vae_config
    assert (vae_config.encode_kernel, vae_config.encode_tile_rows, vae_config.encode_precision) == (True, 2, "fp32")
    assert (vae_config.decode_kernel, vae_config.encode_reuse_steady) == (False, True)
    config.vae_encode_reuse_steady = False
    assert vae_config.encode_reuse_steady is False
    assert PAN2PipelineConfig().vae_encode_kernel is False  # off by default
    with pytest.raises(ValueError, match=r"^vae_encode_backend must be one of \['auto', 'cuda', 'torch'\]; got 'gpu'$"):
        PAN2PipelineConfig(vae_encode_kernel=True, vae_encode_backend="gpu")
    with pytest.raises(ValueError, match=r"^vae_encode_tile_rows / vae_encode_max_memory tile the fast encoder: set "
                                         r"vae_encode_kernel=True \(FastVideo's own Wan VAE encode has no exact "
                                         r"tiling\)$"):
        PAN2PipelineConfig(vae_encode_tile_rows=4)


def _cli(monkeypatch, capsys, *argv):
    from fastvideo.entrypoints.cli.main import main

    monkeypatch.setattr(sys, "argv", ["fastvideo", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code, capsys.readouterr()


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU takes backend cuda")


# Each mistake as typed: one line naming that flag, exit 2, before FastVideo starts a worker (the decoder's too).
@pytest.mark.slow
@pytest.mark.parametrize("flags, line", [
    (["vae_encode_kernel", "true", "vae_encode_precision", "fp16"],
     r"vae_encode_precision must be one of \['auto', 'fp32', 'bf16'\]; got 'fp16'$"),
    (["vae_encode_kernel", "true", "vae_encode_max_memory", "1KiB"],
     r"vae_encode_max_memory='1KiB' cannot encode this request on \w+: max_memory 1\.0 KiB \(1024 bytes\) is too small "
     r"to encode a video into moments \[1, 96, 1, 4, 6\] even in one-row tiles: that needs at least "),
    pytest.param(["vae_encode_kernel", "true", "vae_encode_backend", "cuda"],
                 r"vae_encode_backend='cuda' runs the compiled kernels on a GPU, but torch sees none here", marks=no_gpu),
    pytest.param(["vae_encode_kernel", "true", "vae_encode_backend", "cuda", "vae_encode_precision", "bf16"],
                 r"vae_encode_backend='cuda' runs the compiled kernels on a GPU, but torch sees none here", marks=no_gpu),
    (["vae_decode_kernel", "true", "vae_decode_max_memory", "1KiB"],
     r"vae_decode_max_memory='1KiB' cannot decode this request on \w+: max_memory 1\.0 KiB \(1024 bytes\) is too small "
     r"to decode latents \[1, 48, 3, 4, 6\] "),
    pytest.param(["vae_decode_kernel", "true", "vae_decode_backend", "cuda"],
                 r"vae_decode_backend='cuda' runs the compiled kernels on a GPU, but torch sees none here", marks=no_gpu),
    (["vae_encode_kernal", "true"], r"unknown PAN2 option vae_encode_kernal: did you mean vae_encode_kernel\?$"),
    (["vae_decode_kernel", "true", "vae_decode_tile_row", "2"],
     r"unknown PAN2 option vae_decode_tile_row: did you mean vae_decode_tile_rows\?$"),
], ids=["value", "encode budget", "encode cuda", "encode cuda bf16", "decode budget", "decode cuda", "misspelt switch",
        "misspelt option"])
def test_pan2_cli_encoder_and_decoder_mistakes_are_one_line_before_any_model_loads(tiny_ckpt, tmp_path, monkeypatch,
                                                                                    capsys, flags, line):
    from fastvideo import VideoGenerator

    def no_workers(*args, **kwargs):
        raise AssertionError("FastVideo started its workers")

    monkeypatch.setattr(VideoGenerator, "from_fastvideo_args", classmethod(no_workers))
    image = exif_rotated_jpeg(tmp_path / "a.jpg")
    overrides = [arg for name, value in zip(flags[::2], flags[1::2])
                 for arg in (f"--generator.pipeline.experimental.{name}", value)]
    code, out = _cli(monkeypatch, capsys, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
                     "--request.prompt", "a cat", "--request.inputs.image_path", str(image),
                     "--request.sampling.height", "64", "--request.sampling.width", "96",
                     "--request.sampling.num_frames", "9", "--request.output.output_path", str(tmp_path / "v.mp4"),
                     *overrides)
    assert code == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and re.match("fastvideo generate: error: " + line, lines[0]), lines


@pytest.mark.slow
def test_the_command_lines_budget_check_plans_as_the_workers_do(tiny_ckpt):
    """The check before any model loads plans from the checkpoint's VAE on the meta device: the same refusal as the
    worker's encoder and decoder (made from the real weights) at a budget too small, and both take the least budget
    that refusal names."""
    from diffusers import AutoencoderKLWan

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode, fast_encode
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
    from fastvideo_pan2_ext.vae_kernel.encoder import WanVAEEncoder

    vae, meta = AutoencoderKLWan.from_pretrained(tiny_ckpt / "vae"), fast_decode.meta_vae(tiny_ckpt)
    video = (1, 3, 9, 64, 96)
    for part, check, worker, planned in [
            ("decode", lambda c: fast_decode.check_runs_here(c.vae_config, meta, video, prefix="vae_"),
             lambda budget: WanVAEDecoder(vae, device="cpu", local=True, max_memory=budget),
             lambda w: w.plan((1, 48, 3, 4, 6))),
            ("encode", lambda c: fast_encode.check_runs_here(c, meta, (1, 3, 1, 64, 96), prefix="vae_"),
             lambda budget: WanVAEEncoder(vae, device="cpu", local=True, max_memory=budget),
             lambda w: w.plan((1, 3, 1, 64, 96)))]:
        def config(budget):
            return PAN2PipelineConfig(**{f"vae_{part}_kernel": True, f"vae_{part}_max_memory": budget})

        with pytest.raises(ValueError) as refused:
            check(config("1KiB"))
        with pytest.raises(ValueError) as workers:
            planned(worker("1KiB"))
        assert str(refused.value).endswith(str(workers.value)), (refused.value, workers.value)
        least = int(re.search(r"needs at least .* \((\d+) bytes\)", str(workers.value)).group(1))
        check(config(least))  # taken by both
        assert planned(worker(least)).tile_rows is not None


# --------------------------------------------------------------------------------------------------- end to end


def _generate(tiny_ckpt, image, video, record, *switches: str):
    """`fastvideo generate --pipeline pan2` with the fast decoder on (so the record hook sees the decoded video and
    the latents it came from, before the mp4's quantisation), and `switches`."""
    proc = run([FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
                "--request.prompt", "a cat on a sofa", "--request.inputs.image_path", str(image),
                "--request.sampling.height", str(E2E_HEIGHT), "--request.sampling.width", str(E2E_WIDTH),
                "--request.sampling.num_frames", str(E2E_FRAMES), "--request.sampling.num_inference_steps", "2",
                "--request.sampling.guidance_scale", "1.0", "--request.sampling.seed", "7",
                "--request.output.output_path", str(video),
                "--generator.pipeline.experimental.vae_decode_kernel", "true", *switches],
               env_extra=decode_hook_env(video.parent, f"record:{record}"))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log, torch.load(record)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two real runs (parent + worker each)
def test_pan2_cli_switch_on_gives_the_switch_off_first_frame_latents_within_fp32_rounding(tiny_ckpt, tmp_path):
    image = exif_rotated_jpeg(tmp_path / "first.jpg", 192, 128, orientation=6)
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off_log, off = _generate(tiny_ckpt, image, tmp_path / "off" / "v.mp4", tmp_path / "off" / "record.pt")
    on_log, on = _generate(tiny_ckpt, image, tmp_path / "on" / "v.mp4", tmp_path / "on" / "record.pt",
                           "--generator.pipeline.experimental.vae_encode_kernel", "true")
    assert "fast VAE encoder:" not in off_log
    assert ("fast VAE encoder: precision auto (torch.float32), frames_per_pass auto, tile_rows None, max_memory None, "
            "reuse_steady True, one rank on cpu") in on_log  # in the worker, where the first frame is encoded
    assert "encoding with FastVideo's own encode" not in on_log
    assert on["video"].shape == off["video"].shape == (1, 3, E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH)
    # The first latent frame is the encoded image, kept as is through the denoise: the encoders' own difference,
    # fp32 rounding (measured ~1e-6 of ~6).
    torch.testing.assert_close(on["latents"][:, :, :1], off["latents"][:, :, :1], rtol=0, atol=1e-4)
    # FastVideo rounds the denoiser's input to bf16 whatever the transformer's precision, and the decoder computes in
    # bf16: that fp32 difference flips some of those roundings or none, as the CPU's kernels round. The denoised
    # frames then differ by up to a bf16 step of the largest latent (0.0188 of 6.2 measured on one CPU, 0 on
    # another), and the video by what the tiny checkpoint's random decoder makes of flipped inputs: up to 6.1 8-bit
    # levels with the denoised frames equal, 8.0 with them differing (the fast encode's output scaled by 1 + 3e-6
    # and 1 + 3e-5 times random normals).
    bf16_step = 2.0 ** (torch.floor(torch.log2(off["latents"].abs().max())).item() - 7)
    torch.testing.assert_close(on["latents"], off["latents"], rtol=0, atol=bf16_step)
    torch.testing.assert_close(on["video"].float(), off["video"].float(), rtol=0, atol=16 * 2 / 255)  # [-1, 1]
