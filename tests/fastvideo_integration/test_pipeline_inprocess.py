"""PAN2 inside real FastVideo 0.2.1, in this process: the pipeline built by FastVideo's own `build_pipeline` from the
tiny checkpoint, its two PAN2 stages, the CLI's `--pipeline` flag and the FA4 warning.

FastVideo is imported once for the whole module (it takes ~30 s); the pipeline (conftest's `pan2`) is built once.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from _pan2_helpers import (decompression_bomb_png, exif_rotated_jpeg, fake_flash_attn, forward_batch,
                           make_signoff_images, truncated_png)

from fastvideo_pan2_ext import reference


def test_fastvideo_builds_pan2_pipeline_from_the_public_layout(pan2):
    from fastvideo.pipelines.stages import DecodingStage, InputValidationStage

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig
    from fastvideo_pan2_ext.fastvideo_integration import stages as pan2_stages
    from fastvideo_pan2_ext.model.transformer import PAN2Transformer3DModel

    pipeline, args = pan2
    assert type(pipeline).__name__ == "PAN2Pipeline"
    assert type(args.pipeline_config) is PAN2PipelineConfig  # chosen by FastVideo's own model detection
    stages = {name: type(stage) for name, stage in pipeline._stage_name_mapping.items()}
    assert stages == {"input_validation_stage": pan2_stages.PAN2InputStage,
                      "prompt_encoding_stage": pan2_stages.PAN2TextEncodingStage,
                      "latent_preparation_stage": pan2_stages.PAN2LatentPreparationStage,
                      "condition_stage": pan2_stages.PAN2ConditionStage,
                      "denoising_stage": pan2_stages.PAN2DenoisingStage,
                      "decoding_stage": pan2_stages.PAN2DecodingStage}
    assert issubclass(pan2_stages.PAN2InputStage, InputValidationStage)
    assert issubclass(pan2_stages.PAN2DecodingStage, DecodingStage)
    assert type(pipeline.get_module("transformer")) is PAN2Transformer3DModel  # FastVideo's registry found it
    assert type(pipeline.get_module("text_encoder")).__name__ == "Qwen3_5TextModel"  # transformers' own


@pytest.mark.slow
def test_first_frame_reaches_vae_encoder_bit_identical_to_reference(pan2, tiny_ckpt, tmp_path):
    """Every sign-off file through the real pipeline; the tensor is captured as the condition stage hands it to the
    VAE's encode (the real stage boundary) and compared with `reference.load_first_frame`."""
    pipeline, args = pan2
    vae = pipeline.get_module("vae")
    seen = []
    real_encode = vae.encode

    def recording_encode(x, *a, **k):
        seen.append(x.detach().clone())
        return real_encode(x, *a, **k)

    images = make_signoff_images(tmp_path)
    height, width = 256, 384
    args.output_type = "latent"  # the decoder is not under test here
    vae.encode = recording_encode
    try:
        for path in images:
            batch = forward_batch(args, tiny_ckpt, image_path=str(path), prompt="a cat", height=height, width=width,
                           num_frames=1, num_inference_steps=1, guidance_scale=1.0, save_video=False)
            pipeline.forward(batch, args)
            assert len(seen) == 1, path.name
            expected = reference.load_first_frame(path, height, width)
            assert torch.equal(seen.pop(), expected), path.name
    finally:
        vae.encode = real_encode
        args.output_type = "pil"
    exif = next(p for p in images if p.name == "exif_rotate90.jpg")
    assert reference.load_first_frame(exif, height, width).shape[-2:] == (height, width)  # stored landscape 3:2


def _denormalized(latents, model_path):
    config = json.loads((model_path / "vae" / "config.json").read_text())
    mean = torch.tensor(config["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(config["latents_std"]).view(1, -1, 1, 1, 1)
    return latents * std + mean


@pytest.fixture(scope="module")
def latents():
    return torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(3))


def _decode_through_stage(pipeline, args, latents, tiny_ckpt):
    stage = pipeline._stage_name_mapping["decoding_stage"]
    batch = forward_batch(args, tiny_ckpt, prompt="x")
    batch.latents = latents.clone()
    return stage(batch, args).output


def test_decode_without_kernel_is_fastvideos_own_decode(pan2, latents, tiny_ckpt):
    from fastvideo.pipelines.stages import DecodingStage

    pipeline, args = pan2
    args.pipeline_config.vae_decode_kernel = False
    ours = _decode_through_stage(pipeline, args, latents, tiny_ckpt)
    stock = DecodingStage(vae=pipeline.get_module("vae")).decode(latents.clone(), args).float()
    assert ours.shape == (1, 3, 9, 64, 96)
    assert torch.equal(ours, stock)


def test_decode_with_kernel_is_wanvaedecoder_on_fastvideos_denormalized_latents(pan2, latents, tiny_ckpt):
    from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

    pipeline, args = pan2
    args.pipeline_config.vae_decode_kernel = True
    try:
        for frames_per_pass in (1, 4):
            args.pipeline_config.vae_decode_frames_per_pass = frames_per_pass
            ours = _decode_through_stage(pipeline, args, latents, tiny_ckpt)
            decoder = WanVAEDecoder(pipeline.get_module("vae"), device="cpu", local=True,
                                    frames_per_pass=frames_per_pass)
            direct = decoder.decode(_denormalized(latents, tiny_ckpt))
            assert torch.equal(ours, (direct.float() / 2 + 0.5).clamp(0, 1)), frames_per_pass
    finally:
        args.pipeline_config.vae_decode_kernel = False
        args.pipeline_config.vae_decode_frames_per_pass = "auto"
    assert ours.shape == (1, 3, 9, 64, 96)
    # The allowance (docs/design.md, "Definitions"): against the fp32 reference of the same de-normalized latents,
    # baseline the release bf16 decode. The stage's [0, 1] video maps back to [-1, 1] exactly (bf16 values, fp32 math).
    from _decoder_allowance import check_allowance

    z = _denormalized(latents, tiny_ckpt)
    state_dict = {name: t.detach().float() for name, t in pipeline.get_module("vae").state_dict().items()}
    check_allowance(ours * 2 - 1, reference.decode(z, state_dict, torch.float32),
                    reference.decode(z, state_dict, torch.bfloat16))


def test_text_encoder_offload_gives_the_plain_latents_and_leaves_the_encoder_parked(pan2, tiny_ckpt, monkeypatch):
    """`text_encoder_cpu_offload` on the worker's args (a GPU-less run turns it off when the args are made,
    `compat.cpu_gaps.use_cpu_settings`): two requests in a row each give the plain run's latents, and after each the
    encoder's weights are on the CPU, unchanged. Here the encoder computes where it rests: its move onto a GPU and back
    needs one (docs/design/pan2.md, "PAN2's memory plan")."""
    pipeline, args = pan2
    encoder = pipeline.get_module("text_encoder")
    weights = {name: value.clone() for name, value in encoder.state_dict().items()}
    monkeypatch.setattr(args, "output_type", "latent")  # the decoder is not under test here

    def latents():
        batch = forward_batch(args, tiny_ckpt, prompt="a fox", negative_prompt="blurry", guidance_scale=3.0,
                              height=64, width=96, num_frames=5, num_inference_steps=2, save_video=False,
                              return_trajectory_latents=True)
        return pipeline.forward(batch, args).trajectory_latents

    plain = latents()
    monkeypatch.setattr(args, "text_encoder_cpu_offload", True)
    for _ in range(2):
        torch.testing.assert_close(latents(), plain, rtol=0, atol=0)
        assert {p.device.type for p in encoder.parameters()} == {"cpu"}
        assert all(torch.equal(value, weights[name]) for name, value in encoder.state_dict().items())


# ------------------------------------------------------------------------------------------------------------------
# The CLI, in this process: FastVideo's own `main()` and its `generate` subcommand
# ------------------------------------------------------------------------------------------------------------------


def _cli(monkeypatch, capsys, *argv):
    from fastvideo.entrypoints.cli.main import main

    monkeypatch.setattr(sys, "argv", ["fastvideo", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code, capsys.readouterr()


def _validated(*argv):
    """Parse and validate `fastvideo generate ARGV` with FastVideo's parser and subcommand (no generation)."""
    from fastvideo.entrypoints.cli.generate import GenerateSubcommand
    from fastvideo.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    command = GenerateSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args, unknown = parser.parse_known_args(["generate", *argv])
    args._unknown = unknown
    command.validate(args)
    return args._fastvideo_validated_run_config


def _request(tiny_ckpt, image):
    return ["--generator.model_path", str(tiny_ckpt), "--request.prompt", "a cat",
            "--request.inputs.image_path", str(image)]


def test_generate_help_shows_pipeline_flag(monkeypatch, capsys):
    code, out = _cli(monkeypatch, capsys, "generate", "--help")
    assert code == 0
    assert "--pipeline NAME" in out.out and "pan2" in out.out


def test_pipeline_pan2_needs_no_config_and_keeps_dotted_overrides(pan2, tiny_ckpt, tmp_path):
    from fastvideo.api.compat import generator_config_to_fastvideo_args

    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    image = exif_rotated_jpeg(tmp_path / "a.jpg")
    run = _validated("--pipeline", "pan2", *_request(tiny_ckpt, image), "--request.sampling.height", "64",
                     "--request.sampling.seed", "7", "--generator.pipeline.experimental.vae_decode_kernel", "true",
                     "--generator.pipeline.experimental.vae_decode_frames_per_pass", "2",
                     "--generator.pipeline.experimental.vae_decode_max_memory", "8GiB",
                     "--generator.pipeline.experimental.flow_shift", "3.0")
    sampling = run.request.sampling
    assert (sampling.height, sampling.width, sampling.num_frames, sampling.fps, sampling.seed) == (64, 1248, 241, 24, 7)
    fastvideo_args = generator_config_to_fastvideo_args(run.generator)
    config = fastvideo_args.pipeline_config
    assert type(config) is PAN2PipelineConfig
    assert (config.vae_decode_kernel, config.vae_decode_frames_per_pass, config.flow_shift) == (True, 2, 3.0)
    assert (config.vae_decode_max_memory, config.vae_decode_tile_rows) == ("8GiB", None)
    assert fastvideo_args.override_pipeline_cls_name == "PAN2Pipeline"


def test_pipeline_pan2_with_a_config_file(pan2, tiny_ckpt, tmp_path):
    image = exif_rotated_jpeg(tmp_path / "a.jpg")
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"generator": {"model_path": str(tiny_ckpt)},
                                  "request": {"prompt": "x", "inputs": {"image_path": str(image)},
                                              "sampling": {"num_frames": 9}}}))
    pipeline_json = tmp_path / "pipeline.json"
    pipeline_json.write_text(json.dumps({"flow_shift": 7.0, "vae_decode_kernel": True}))
    run = _validated("--pipeline", "pan2", "--config", str(config), "--request.sampling.width", "96",
                     "--generator.pipeline.components.pipeline_config_path", str(pipeline_json))
    assert (run.request.sampling.num_frames, run.request.sampling.width, run.request.sampling.height) == (9, 96, 704)
    pan2_config = run.generator.pipeline.experimental["pipeline_config"]
    assert (pan2_config.flow_shift, pan2_config.vae_decode_kernel) == (7.0, True)


def test_without_pipeline_flag_generate_is_unchanged(monkeypatch, capsys):
    from fastvideo.entrypoints.cli.main import main

    monkeypatch.setattr(sys, "argv", ["fastvideo", "generate", "--request.prompt", "x"])
    with pytest.raises(ValueError, match="fastvideo generate requires --config PATH"):
        main()


def _bad_input_cases(tiny_ckpt, wan22_stock, tmp_path):
    image = exif_rotated_jpeg(tmp_path / "ok.jpg")
    old_vae = tmp_path / "pan2-old-vae"
    shutil.copytree(tiny_ckpt, old_vae)
    vae_config = json.loads((old_vae / "vae" / "config.json").read_text())
    (old_vae / "vae" / "config.json").write_text(json.dumps({**vae_config, "is_residual": False}))
    text = tmp_path / "text.png"
    text.write_text("hello")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    good = _request(tiny_ckpt, image)
    return {
        "unknown pipeline": (["--pipeline", "pan3", *good], r"unknown --pipeline 'pan3'; known pipelines: pan2"),
        "missing image": ([*good[:-1], str(tmp_path / "none.jpg")], r"image file not found: '.*none\.jpg'"),
        "unreadable image": ([*good[:-1], str(text)], r"cannot read image '.*text\.png': not a recognised"),
        "empty image": ([*good[:-1], str(empty)], r"image file is empty \(0 bytes\): '.*empty\.jpg'"),
        "num_frames not 4k + 1": ([*good, "--request.sampling.num_frames", "10"],
                                  r"num_frames must be 4k \+ 1 .*; got 10: ask for 9 or 13"),
        "output folder under a file": ([*good, "--request.output.output_path", str(a_file / "out" / "v.mp4")],
                                       r"cannot write the video to .*a-file/out: .*a-file is a file, not a folder"),
        "output folder on a read-only file system": ([*good, "--request.output.output_path", "/proc/pan2/v.mp4"],
                                                     r"cannot write the video to /proc/pan2: "),
        "truncated image": ([*good[:-1], str(truncated_png(tmp_path / "cut.png"))], r"cannot read image '.*cut"),
        "decompression bomb": ([*good[:-1], str(decompression_bomb_png(tmp_path / "bomb.png", 12000, 9000))],
                               r"12000x9000 = 108 MP, over the 89 MP limit"),
        "height not multiple of 32": ([*good, "--request.sampling.height", "100"],
                                      r"height must be a positive multiple of 32; got 100"),
        "width not multiple of 32": ([*good, "--request.sampling.width", "1250"],
                                     r"width must be a positive multiple of 32; got 1250"),
        "a Wan2.2 checkpoint": (["--generator.model_path", str(wan22_stock), *good[2:]],
                                r"is not a PAN2 checkpoint: its manifest's _class_name is 'WanPipeline' \(expected "
                                r"one of PAN2ModularPipeline, PAN2Pipeline\)"),
        "Wan2.1 VAE": (["--generator.model_path", str(old_vae), *good[2:]], r"vae/config.json is not a Wan2.2 VAE"),
        "not a folder": (["--generator.model_path", str(image), *good[2:]], r"is not a folder"),
        "no model path": (good[2:], r"--pipeline pan2 needs a checkpoint: --generator.model_path PATH"),
        "bad PAN2 field": ([*good, "--generator.pipeline.experimental.vae_decode_frames_per_pass", "0"],
                           r"vae_decode_frames_per_pass must be 'auto' or an int >= 1; got 0"),
        "two videos per request": ([*good, "--request.sampling.num_videos_per_prompt", "2"],
                                   r"PAN2 makes one video per request .* got num_videos_per_prompt=2"),
        "tiles without the fast decoder": ([*good, "--generator.pipeline.experimental.vae_decode_tile_rows", "4"],
                                           r"tile the fast decoder: set vae_decode_kernel=True"),
        "bad memory budget": ([*good, "--generator.pipeline.experimental.vae_decode_kernel", "true",
                               "--generator.pipeline.experimental.vae_decode_max_memory", "lots"],
                              r"vae_decode_max_memory must be bytes \(int\) or a string like '2GiB'"),
    }


@pytest.mark.slow
def test_bad_input_gets_one_clear_error_line(pan2, tiny_ckpt, wan22_stock, tmp_path, monkeypatch, capsys):
    import re

    cases = _bad_input_cases(tiny_ckpt, wan22_stock, tmp_path)
    monkeypatch.setenv("FASTVIDEO_FA4", "banana")
    cases["FASTVIDEO_FA4 neither 0 nor 1"] = (_request(tiny_ckpt, tmp_path / "ok.jpg"),
                                             r"FASTVIDEO_FA4 must be unset, 0 or 1; got 'banana'")
    for case, (argv, message) in cases.items():
        if case.startswith("FASTVIDEO_FA4"):
            monkeypatch.setenv("FASTVIDEO_FA4", "banana")
        else:
            monkeypatch.delenv("FASTVIDEO_FA4", raising=False)
        if argv[0] != "--pipeline":
            argv = ["--pipeline", "pan2", *argv]
        code, out = _cli(monkeypatch, capsys, "generate", *argv)
        lines = out.err.strip().splitlines()
        assert code == 2, case
        assert len(lines) == 1 and lines[0].startswith("fastvideo generate: error: "), (case, out.err)
        assert re.search(message, lines[0]), (case, lines[0])


def test_fa4_policy_warns_when_fastvideos_flash_attention_is_already_loaded(pan2, tmp_path, monkeypatch, caplog):
    """A real FastVideo flash-attention module imported (against a stand-in flash_attn) before the policy runs."""
    import importlib

    from fastvideo_pan2_ext.attention import apply_fa4_policy, fa4

    monkeypatch.syspath_prepend(str(fake_flash_attn(tmp_path)))
    monkeypatch.delenv("FASTVIDEO_FA4", raising=False)
    monkeypatch.setattr(fa4, "_current_capability", lambda: (10, 0))
    added = [m for m in ("fastvideo.attention.utils.flash_attn_default", ) if m not in sys.modules]
    try:
        importlib.import_module("fastvideo.attention.utils.flash_attn_default")
        with caplog.at_level("WARNING", logger="fastvideo_pan2_ext.attention.fa4"):
            assert apply_fa4_policy() is True
        assert os.environ["FASTVIDEO_FA4"] == "1"
        assert any("fastvideo.attention.utils.flash_attn_default already imported" in r.getMessage()
                   for r in caplog.records)
    finally:
        for name in [*added, *(m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn."))]:
            sys.modules.pop(name, None)


def test_python_api_pan2_config_selects_pan2_pipeline_and_refuses_other_checkpoints(pan2, tiny_ckpt, wan22_stock):
    from fastvideo.fastvideo_args import FastVideoArgs

    from fastvideo_pan2_ext.fastvideo_integration.checkpoint import NotPAN2CheckpointError
    from fastvideo_pan2_ext.configs import PAN2PipelineConfig

    args = FastVideoArgs.from_kwargs(model_path=str(tiny_ckpt), pipeline_config=PAN2PipelineConfig())
    assert args.override_pipeline_cls_name == "PAN2Pipeline"
    with pytest.raises(NotPAN2CheckpointError, match=r"is not a PAN2 checkpoint: its manifest's _class_name is "
                                                     r"'WanPipeline'"):
        FastVideoArgs.from_kwargs(model_path=str(wan22_stock), pipeline_config=PAN2PipelineConfig())
