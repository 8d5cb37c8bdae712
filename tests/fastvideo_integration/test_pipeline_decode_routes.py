"""The PAN2 decoding stage's routes, in the real FastVideo 0.2.1 pipeline built from the tiny checkpoint: the fast
decoder plain, in exact tiles, under a memory budget and streamed to an mp4, for a batch of 2 at an odd latent size;
and what FastVideo's own VAE switches (`vae_tiling`, `vae_config.use_feature_cache`) do to PAN2.

The stage is called as FastVideo calls it (`stage(batch, args)`), with the batch fields FastVideo sets. FastVideo
0.2.1's denoiser cannot produce a batch of 2 (it asserts batch size 1), so batches reach the stage here directly.
"""

from __future__ import annotations

import contextlib
import logging

import imageio
import pytest
import torch
from _pan2_helpers import forward_batch

from fastvideo_pan2_ext.fastvideo_integration import fast_decode, streamed_save

# Batch 2, odd latent height and width: 48 x 80 px frames, 9 frames (two decoder passes at frames_per_pass 2).
LATENTS = torch.randn(2, 48, 3, 3, 5, generator=torch.Generator().manual_seed(5))
VIDEO_SHAPE = (2, 3, 9, 48, 80)
# Tiles hold less than the whole frame only where it is taller than a tile's margins reach: the budgets tile these.
TALL = torch.randn(2, 48, 3, 6, 3, generator=torch.Generator().manual_seed(6))


@contextlib.contextmanager
def _config(args, **fields):
    config = args.pipeline_config
    saved = {name: getattr(config, name) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        config.check_vae_options()  # what the next request does


def _stage_output(pan2, tiny_ckpt, latents, stream_to=None, **fields):
    pipeline, args = pan2
    stage = pipeline._stage_name_mapping["decoding_stage"]
    batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
    batch.latents = latents.clone()
    if stream_to is not None:
        batch.extra[streamed_save.KEY] = streamed_save.StreamedSaveRequest(str(stream_to), 24)
    with _config(args, vae_decode_frames_per_pass=2, **fields):
        return stage(batch, args).output


def _fastvideo_save(output: torch.Tensor, path) -> None:
    """FastVideo 0.2.1's save of a decoded [B, 3, F, H, W] video in [0, 1] (VideoGenerator._generate_single_video):
    quantise, one `make_grid(nrow=6)` image per frame, `imageio.mimsave`."""
    from torchvision.utils import make_grid

    vid_u8 = (output * 255).clamp_(0, 255).to(torch.uint8).permute(2, 0, 1, 3, 4)  # t b c h w
    frames = [make_grid(x, nrow=6).permute(1, 2, 0).squeeze(-1).contiguous().numpy() for x in vid_u8]
    imageio.mimsave(path, frames, fps=24, format="mp4")


@pytest.fixture(scope="module")
def plain(pan2, tiny_ckpt):
    """The fast decoder's untiled decode of LATENTS through the stage."""
    return _stage_output(pan2, tiny_ckpt, LATENTS, vae_decode_kernel=True)


@pytest.fixture(scope="module")
def plain_tall(pan2, tiny_ckpt):
    """The fast decoder's untiled decode of TALL through the stage."""
    return _stage_output(pan2, tiny_ckpt, TALL, vae_decode_kernel=True)


def _budget_that_tiles(pan2) -> int:
    """A budget between one-row tiles' and the untiled decode's planned peak (so max_memory must tile)."""
    decoder = fast_decode.decoder_for(pan2[0].get_module("vae"), torch.device("cpu"))
    shape = TALL[:1].shape
    return int(1.3 * (decoder.peak_bytes(shape, tile_rows=1) + decoder.peak_bytes(shape)) / 2)


@pytest.mark.slow
def test_fast_decoder_decodes_each_sample_of_a_batch_as_alone(pan2, tiny_ckpt, plain):
    assert plain.shape == VIDEO_SHAPE and plain.dtype == torch.float32
    for b in range(2):
        alone = _stage_output(pan2, tiny_ckpt, LATENTS[b:b + 1], vae_decode_kernel=True)
        assert torch.equal(alone, plain[b:b + 1])


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{"vae_decode_tile_rows": 1}, {"vae_decode_tile_rows": 2}, "budget"],
                         ids=["tile_rows=1", "tile_rows=2", "max_memory"])
def test_tiled_and_budgeted_decodes_are_the_untiled_decode(pan2, tiny_ckpt, plain, plain_tall, fields):
    latents, expected = LATENTS, plain
    if fields == "budget":
        fields, latents, expected = {"vae_decode_max_memory": _budget_that_tiles(pan2)}, TALL, plain_tall
    tiled = _stage_output(pan2, tiny_ckpt, latents, vae_decode_kernel=True, **fields)
    assert torch.equal(tiled, expected)
    with _config(pan2[1], vae_decode_kernel=True, vae_decode_frames_per_pass=2, **fields) as config:
        config.check_vae_options()
        decoder = fast_decode.decoder_for(pan2[0].get_module("vae"), torch.device("cpu"))  # the one that decoded
        assert decoder.plan(latents.shape).tile_rows is not None  # it really decoded in tiles


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tile_rows", [None, 1, 2])
def test_streamed_save_is_fastvideos_save_of_the_decoded_video(pan2, tiny_ckpt, plain, tmp_path, batch, tile_rows):
    """The stage writes the mp4 as it decodes and hands on the video's shape without frames; the file is
    byte-identical to what FastVideo's save writes for the non-streamed output (a batch as one grid video)."""
    streamed = tmp_path / "streamed.mp4"
    output = _stage_output(pan2, tiny_ckpt, LATENTS[:batch], stream_to=streamed, vae_decode_kernel=True,
                           vae_decode_tile_rows=tile_rows)
    assert output.shape == (batch, 3, 0, 48, 80)
    _fastvideo_save(plain[:batch], tmp_path / "fastvideo.mp4")
    assert streamed.read_bytes() == (tmp_path / "fastvideo.mp4").read_bytes()


def test_a_budget_too_small_for_one_row_tiles_is_a_clear_error(pan2, tiny_ckpt, plain):
    with pytest.raises(ValueError, match=r"max_memory 1\.0 MiB \(1048576 bytes\) is too small to decode latents "
                       r"\[2, 48, 3, 3, 5\] even in one-row tiles: that needs at least"):
        _stage_output(pan2, tiny_ckpt, LATENTS, vae_decode_kernel=True, vae_decode_max_memory="1MiB")


@pytest.mark.slow
def test_a_budget_that_tiles_a_decode_can_be_too_small_to_stream_it(pan2, tiny_ckpt, plain_tall, tmp_path):
    """Streamed tiles advance together, so every tile's causal history is alive at once: at this small frame no
    tile size streams within a budget that one-at-a-time tiles fit. The stage says so before writing any frame, and
    keeps the latents (a failed decode after denoising never loses them: `fastvideo_integration.kept_latents`)."""
    import re

    from fastvideo_pan2_ext.fastvideo_integration import decode_failure

    budget = _budget_that_tiles(pan2)
    assert torch.equal(_stage_output(pan2, tiny_ckpt, TALL, vae_decode_kernel=True, vae_decode_max_memory=budget),
                       plain_tall)
    pipeline, args = pan2
    batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
    batch.latents = TALL.clone()
    batch.extra[streamed_save.KEY] = streamed_save.StreamedSaveRequest(str(tmp_path / "x.mp4"), 24)
    batch.extra[decode_failure.REQUEST_KEY] = decode_failure.KeepLatentsRequest.beside(tmp_path / "x.mp4", 24)
    with _config(args, vae_decode_frames_per_pass=2, vae_decode_kernel=True, vae_decode_max_memory=budget):
        failure = pipeline._stage_name_mapping["decoding_stage"](batch, args).extra[decode_failure.FAILURE_KEY]
    assert re.search(r"ValueError: max_memory .* is too small to decode latents \[1, 48, 3, 6, 3\] streamed "
                     r"\(decode_iter\) in any tile size: that needs at least", failure.error), failure.error
    assert not (tmp_path / "x.mp4").exists() and failure.latents == str(tmp_path / "x.latents.safetensors")
    assert (tmp_path / "x.latents.safetensors").is_file()


def test_options_set_after_the_config_was_made_are_checked_at_decode(pan2, tiny_ckpt):
    with pytest.raises(ValueError, match=r"vae_decode_tile_rows must be an int >= 1 \(latent rows per tile\) or None; "
                       r"got 0"):
        _stage_output(pan2, tiny_ckpt, LATENTS, vae_decode_kernel=True, vae_decode_tile_rows=0)
    with pytest.raises(ValueError, match=r"tile the fast decoder: set vae_decode_kernel=True"):
        _stage_output(pan2, tiny_ckpt, LATENTS, vae_decode_kernel=False, vae_decode_tile_rows=2)


# ------------------------------------------------------------------------------------------------------------------
def test_fastvideos_own_switch_set_on_a_pan2_config_is_obeyed(pan2, tiny_ckpt, plain):
    """`vae_config.decode_kernel=True` (the generic switch, as a CLI override sets it after the config was made)
    decodes a PAN2 request with the fast decoder: PAN2's `vae_decode_kernel` is a view of it."""
    pipeline, args = pan2
    with _config(args, vae_decode_frames_per_pass=2, vae_decode_kernel=False) as config:
        config.vae_config.decode_kernel = True
        assert config.vae_decode_kernel
        batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        batch.latents = LATENTS.clone()
        output = pipeline._stage_name_mapping["decoding_stage"](batch, args).output
    assert torch.equal(output, plain)
    assert not args.pipeline_config.vae_config.decode_kernel


def test_a_light_wan_vae_with_the_fast_decoder_is_a_clear_error(pan2):
    from fastvideo.configs.models.vaes import WanVAEConfig

    config = WanVAEConfig(use_light_vae=True)
    config.decode_kernel = True
    with pytest.raises(ValueError, match=r"cannot decode a light VAE \(vae_config.use_light_vae=True"):
        fast_decode.options(config)
    config.decode_kernel = False
    assert fast_decode.options(config) is None


# FastVideo's own VAE switches, as they act on PAN2 (the non-kernel route and the first-frame encode)
# ------------------------------------------------------------------------------------------------------------------


def test_defaults_of_fastvideos_vae_switches_for_pan2(pan2):
    _, args = pan2
    config = args.pipeline_config
    assert (config.vae_tiling, config.vae_sp, config.vae_precision, config.vae_decode_precision) == (
        False, False, "fp32", "bf16")
    vae = config.vae_config
    assert (vae.use_feature_cache, vae.use_tiling, vae.use_temporal_tiling, vae.use_parallel_tiling) == (
        True, False, False, False)
    assert (config.vae_decode_kernel, config.vae_decode_frames_per_pass, config.vae_decode_tile_rows,
            config.vae_decode_max_memory) == (False, "auto", None, None)


def test_vae_tiling_leaves_fastvideos_pan2_decode_unchanged_and_says_so(pan2, tiny_ckpt, caplog):
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    pipeline, _ = pan2
    vae = pipeline.get_module("vae")
    untiled = _stage_output(pan2, tiny_ckpt, LATENTS[:1], vae_decode_kernel=False)
    try:
        tiled = _stage_output(pan2, tiny_ckpt, LATENTS[:1], vae_decode_kernel=False, vae_tiling=True)
        assert vae.use_tiling  # FastVideo's stage did turn tiling on ...
    finally:
        vae.disable_tiling()
    assert torch.equal(tiled, untiled)  # ... and its feature-cache decode ignored it
    with caplog.at_level(logging.WARNING, logger="fastvideo_pan2_ext.configs.pan2"):
        PAN2PipelineConfig(vae_tiling=True)
    assert any("vae_tiling=True changes nothing for PAN2" in r.getMessage() for r in caplog.records)


def test_fastvideos_tiled_wan_vae_paths_break_wan22_so_pan2_refuses_them(pan2):
    """Why `use_feature_cache=False` is refused: FastVideo 0.2.1's generic (tiled) Wan VAE paths skip Wan2.2's
    patchify/unpatchify. If this test starts failing, FastVideo fixed it and the refusal can go."""
    from fastvideo.configs.models.vaes import WanVAEConfig

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    pipeline, _ = pan2
    vae = pipeline.get_module("vae")
    vae.use_feature_cache = False
    try:
        with torch.no_grad():
            decoded = vae.decode(LATENTS[:1])
            with pytest.raises(RuntimeError, match="expected input.* to have 12 channels, but got 3"):
                vae.encode(torch.zeros(1, 3, 1, 48, 80))
    finally:
        vae.use_feature_cache = True
    assert decoded.shape[1] == 12  # patchified channels, not RGB
    with pytest.raises(ValueError, match=r"vae_config.use_feature_cache=False is not supported for PAN2"):
        PAN2PipelineConfig(vae_config=WanVAEConfig(use_feature_cache=False))


@pytest.mark.parametrize("fields, message", [
    ({"vae_decode_kernel": True, "vae_decode_tile_rows": 0}, r"vae_decode_tile_rows must be an int >= 1"),
    ({"vae_decode_kernel": True, "vae_decode_tile_rows": 2.5}, r"vae_decode_tile_rows must be an int >= 1"),
    ({"vae_decode_kernel": True, "vae_decode_tile_rows": True}, r"vae_decode_tile_rows must be an int >= 1"),
    ({"vae_decode_kernel": True, "vae_decode_max_memory": "-3GiB"}, r"vae_decode_max_memory must be"),
    ({"vae_decode_kernel": True, "vae_decode_max_memory": 0}, r"vae_decode_max_memory must be positive"),
    ({"vae_decode_kernel": True, "vae_decode_tile_rows": 2, "vae_decode_max_memory": "1GiB"}, r"not both"),
    ({"vae_decode_max_memory": "1GiB"}, r"tile the fast decoder: set vae_decode_kernel=True"),
    ({"vae_decode_frames_per_pass": 0}, r"vae_decode_frames_per_pass must be 'auto' or an int >= 1; got 0"),
])
def test_bad_decode_options_are_clear_errors(pan2, fields, message):
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    with pytest.raises(ValueError, match=message):
        PAN2PipelineConfig(**fields)


def test_good_decode_options_are_kept(pan2):
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    config = PAN2PipelineConfig(vae_decode_kernel=True, vae_decode_max_memory="12 GiB")
    assert (config.vae_decode_max_memory, config.vae_decode_tile_rows) == ("12 GiB", None)
    assert PAN2PipelineConfig(vae_decode_kernel=True, vae_decode_tile_rows=8).vae_decode_tile_rows == 8


def test_more_than_one_video_per_request_is_refused_before_any_work(pan2, tiny_ckpt, tmp_path):
    """`VideoGenerator._generate_single_video` (what every generate call reaches) refuses it for PAN2 before it
    touches its executor: this generator has none."""
    from fastvideo import VideoGenerator
    from fastvideo.api.sampling_param import SamplingParam

    _, args = pan2
    generator = object.__new__(VideoGenerator)
    generator.fastvideo_args = args
    sampling = SamplingParam.from_pretrained(str(tiny_ckpt))
    sampling.num_videos_per_prompt = 3
    with pytest.raises(ValueError, match=r"PAN2 makes one video per request .* got num_videos_per_prompt=3"):
        generator._generate_single_video("a cat", sampling, args, output_path=str(tmp_path / "x.mp4"))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "fastvideo-saves"])
def test_a_failed_requests_partial_file_is_released_when_it_ends(tiny_ckpt, tmp_path, streamed):
    """A request that fails in FastVideo (here its forward: this generator has no executor), made as the server's job
    thread makes one, leaves no partial file and nothing listed for the end of the process (a server's failed and
    deleted jobs used to stay listed until it stopped)."""
    from fastvideo import VideoGenerator
    from fastvideo.api.sampling_param import SamplingParam
    from fastvideo.fastvideo_args import FastVideoArgs

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig
    from fastvideo_pan2_ext.fastvideo_integration import cancel, request_failure

    args = FastVideoArgs.from_kwargs(model_path=str(tiny_ckpt),
                                     pipeline_config=PAN2PipelineConfig(vae_decode_kernel=streamed))
    generator = object.__new__(VideoGenerator)
    generator.fastvideo_args = args
    sampling = SamplingParam.from_pretrained(str(tiny_ckpt))
    sampling.save_video, sampling.return_frames = True, False
    assert streamed_save.streams(args, sampling) == streamed
    listed = set(streamed_save._in_flight)
    (tmp_path / "out").mkdir()
    with request_failure.failing_alone(), cancel.cancellable(cancel.CancelFlag(str(tmp_path / "flag"))):
        with pytest.raises(RuntimeError, match="Forward execution thread failed"):
            generator._generate_single_video("a cat", sampling, args, output_path=str(tmp_path / "out" / "x.mp4"))
    assert streamed_save._in_flight == listed
    assert not any((tmp_path / "out").iterdir())


def test_only_save_only_pixel_requests_on_local_workers_with_the_fast_decoder_stream(pan2, tiny_ckpt):
    from fastvideo.api.sampling_param import SamplingParam

    from fastvideo_pan2_ext.fastvideo_integration.streamed_save import streams

    _, args = pan2
    sampling = SamplingParam.from_pretrained(str(tiny_ckpt))
    sampling.save_video, sampling.return_frames = True, False
    with _config(args, vae_decode_kernel=True) as config:
        config.check_vae_options()  # as the parent does before every PAN2 request
        assert streams(args, sampling)
        for field, value in (("save_video", False), ("return_frames", True)):
            setattr(sampling, field, value)
            assert not streams(args, sampling), field
            sampling.save_video, sampling.return_frames = True, False
        for field, value in (("output_type", "latent"), ("distributed_executor_backend", "ray")):
            saved = getattr(args, field)
            setattr(args, field, value)
            try:
                assert not streams(args, sampling), field
            finally:
                setattr(args, field, saved)
    assert not streams(args, sampling)  # vae_decode_kernel=False: FastVideo's decode and save


def test_pan2_switches_are_views_of_the_vae_config_and_the_old_name_still_works(pan2):
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig
    from fastvideo_pan2_ext.vae_kernel.options import NAMES

    config = PAN2PipelineConfig(vae_decode_kernel=True, vae_decode_conv_algorithm="winograd")
    assert config.vae_config.decode_kernel is True and config.vae_config.decode_conv_algorithm == "winograd"
    config.vae_config.decode_tile_rows = 3  # set on the Wan VAE config: PAN2's switch shows it, no sync needed
    assert config.vae_decode_tile_rows == 3
    assert {f"vae_decode_{name}" for name in NAMES} | {"vae_decode_kernel"} <= set(dir(config))
    with pytest.warns(DeprecationWarning, match=r"vae_frames_per_pass is deprecated: use vae_decode_frames_per_pass"):
        old = PAN2PipelineConfig(vae_frames_per_pass=2)
    assert old.vae_decode_frames_per_pass == old.vae_config.decode_frames_per_pass == 2
    with pytest.raises(ValueError, match=r"vae_decode_frames_per_pass must be 'auto' or an int >= 1; got 0"):
        PAN2PipelineConfig(vae_decode_frames_per_pass=0)


def test_a_request_of_the_wrong_type_in_batch_extra_is_a_clear_error(pan2, tiny_ckpt, tmp_path):
    from fastvideo_pan2_ext.fastvideo_integration import decode_failure

    pipeline, args = pan2
    for key, wrong, expected in ((streamed_save.KEY, str(tmp_path / "x.mp4"), "StreamedSaveRequest"),
                                 (decode_failure.REQUEST_KEY, {"output": "x.mp4"}, "KeepLatentsRequest")):
        batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        batch.latents = LATENTS.clone()
        batch.extra[key] = wrong
        with _config(args, vae_decode_kernel=True), pytest.raises(
                TypeError, match=rf"batch.extra\['{key}'\] must be a {expected}; got {type(wrong).__name__}"):
            pipeline._stage_name_mapping["decoding_stage"](batch, args)
