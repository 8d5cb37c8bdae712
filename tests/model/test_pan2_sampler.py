"""PAN2 through FastVideo against its definition (`reference.py`): the tiny public-layout checkpoint, built in this
process as a FastVideo worker builds it, runs the sampler; the reference runs the same checkpoint's files with its own
plain-PyTorch transformer, prompt encoding, first frame and Euler loop. fp32 end to end: the final latents agree to
fp32 rounding; FastVideo's default precision (bf16 DiT and text encoder): within the stated bf16 allowance.

The cases: text-to-video; image-to-video from an EXIF-rotated JPEG; a negative prompt with guidance 3.0; a width whose
patch grid is odd (96 px -> 3 patch columns). The mutation tests at the end break each rule in the product on purpose
(injected from the test) and show that the comparison then fails: the tiny checkpoint is sensitive to every rule.
"""

from __future__ import annotations

import json

import pytest
import torch

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.model.architecture import LATENT_CHANNELS, PAN2TransformerConfig

pytestmark = pytest.mark.slow

HEIGHT, WIDTH, FRAMES, STEPS, SEED = 64, 96, 5, 3, 7
PROMPT = "a red fox runs through fresh snow at dawn"


def _load_reference_parts(ckpt, text_dtype):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3_5TextModel

    config = PAN2TransformerConfig.from_json(json.loads((ckpt / "transformer" / "config.json").read_text()))
    state = load_file(ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    vae_config = json.loads((ckpt / "vae" / "config.json").read_text())
    vae_state = load_file(ckpt / "vae" / "diffusion_pytorch_model.safetensors")
    shift = json.loads((ckpt / "scheduler" / "scheduler_config.json").read_text())["shift"]
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    text_encoder = Qwen3_5TextModel.from_pretrained(ckpt / "text_encoder", dtype=text_dtype).eval()
    return config, state, vae_config, vae_state, shift, tokenizer, text_encoder


@torch.no_grad()
def reference_latents(ckpt, *, prompt, negative_prompt="", image=None, guidance=1.0, height=HEIGHT, width=WIDTH,
                      frames=FRAMES, steps=STEPS, seed=SEED, dtype=torch.float32, text_dtype=torch.float32):
    """PAN2's final latents by `reference.py` alone, from the checkpoint's files."""
    config, state, vae_config, vae_state, shift, tokenizer, text_encoder = _load_reference_parts(ckpt, text_dtype)
    positive = reference.pan2_prompt_embeds(prompt, tokenizer, text_encoder).to(dtype)
    negative = reference.pan2_prompt_embeds(negative_prompt, tokenizer, text_encoder).to(dtype) if guidance > 1 \
        else None
    shape = (1, LATENT_CHANNELS, (frames - 1) // 4 + 1, height // 16, width // 16)
    first = None if image is None else reference.load_first_frame(image, height, width)
    condition = reference.pan2_condition(first, vae_state, vae_config["latents_mean"], vae_config["latents_std"],
                                         shape)
    noise = reference.pan2_noise(seed, shape)
    sigmas = reference.pan2_sigmas(steps, shift)
    return reference.pan2_sample(state, config, positive, negative, condition, noise, sigmas, guidance, dtype)


def _build(ckpt, **config_fields):
    from fastvideo.fastvideo_args import FastVideoArgs
    from fastvideo.pipelines import build_pipeline

    from fastvideo_pan2_ext import PAN2PipelineConfig

    args = FastVideoArgs.from_kwargs(model_path=str(ckpt), num_gpus=1,
                                     pipeline_config=PAN2PipelineConfig(**config_fields))
    pipeline = build_pipeline(args)
    pipeline.post_init()
    return pipeline, args


@pytest.fixture(scope="module")
def pipelines(pan2, tiny_ckpt):
    """The fp32 and the default-precision pipeline, built in this process as a FastVideo worker builds them, in the
    distributed environment of the session's `pan2` (which ends it when the session ends)."""
    return {"fp32": _build(tiny_ckpt, dit_precision="fp32", text_encoder_precisions=("fp32", )),
            "default": _build(tiny_ckpt)}


def run_pipeline(pipeline, args, ckpt, *, prompt, negative_prompt="", image=None, guidance=1.0, height=HEIGHT,
                 width=WIDTH, frames=FRAMES, steps=STEPS, seed=SEED):
    """FastVideo's trajectory: the latents after every step, [steps, 48, T', h, w]."""
    from _pan2_helpers import forward_batch

    batch = forward_batch(args, ckpt, prompt=prompt, negative_prompt=negative_prompt,
                          image_path=None if image is None else str(image), guidance_scale=guidance, height=height,
                          width=width, num_frames=frames, num_inference_steps=steps, seed=seed,
                          return_trajectory_latents=True, save_video=False, return_frames=False)
    batch = pipeline.forward(batch, args)
    return batch.trajectory_latents[0]


CASES = {
    "t2v": dict(prompt=PROMPT),
    "i2v-exif": dict(prompt=PROMPT, image="EXIF"),
    "negative-cfg3": dict(prompt=PROMPT, negative_prompt="blurry, static, low quality", guidance=3.0),
}


def _case(name, tmp_path):
    from _pan2_helpers import exif_rotated_jpeg

    kwargs = dict(CASES[name])
    if kwargs.get("image") == "EXIF":
        # 198 x 128 covers the 96 x 64 canvas at 99 x 64: the centre crop's offset 1.5 rounds (to 2), not floors.
        kwargs["image"] = exif_rotated_jpeg(tmp_path / "first.jpg", width=198, height=128)
    return kwargs


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_pipeline_is_the_reference_to_fp32_rounding(pipelines, tiny_ckpt, tmp_path, name):
    kwargs = _case(name, tmp_path)
    got = run_pipeline(*pipelines["fp32"], tiny_ckpt, **kwargs)
    want = torch.stack(reference_latents(tiny_ckpt, **kwargs), dim=1)[0]
    assert got.shape == want.shape == (STEPS, LATENT_CHANNELS, (FRAMES - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16)
    scale = want.abs().max().item()
    assert scale > 0.5  # not a degenerate run
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("name", sorted(CASES))
def test_default_precision_is_the_reference_within_the_bf16_allowance(pipelines, tiny_ckpt, tmp_path, name):
    """Allowance: the pipeline's distance from the fp32 reference at most 3x (+ 1% of the latents' scale) the
    reference's own bf16 run's distance from it (the DiT and the text encoder in bf16, the latents fp32)."""
    kwargs = _case(name, tmp_path)
    got = run_pipeline(*pipelines["default"], tiny_ckpt, **kwargs)[-1]
    exact = reference_latents(tiny_ckpt, **kwargs)[-1][0]
    bf16 = reference_latents(tiny_ckpt, dtype=torch.bfloat16, text_dtype=torch.bfloat16, **kwargs)[-1][0]
    baseline = (bf16 - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert baseline > 0  # bf16 does change the result: the comparison below can fail
    assert (got - exact).abs().max().item() <= 3 * baseline + 0.01 * scale


def _mutate_rope_to_neox(monkeypatch, pipeline):
    import fastvideo.attention.layer as layer

    rotate = layer._apply_rotary_emb
    monkeypatch.setattr(layer, "_apply_rotary_emb", lambda x, cos, sin, is_neox_style: rotate(x, cos, sin, True))


def _mutate_hidden_layer(monkeypatch, pipeline):
    from fastvideo_pan2_ext.fastvideo_integration import stages

    monkeypatch.setattr(stages, "HIDDEN_LAYER", -2)


def _mutate_template_crop(monkeypatch, pipeline):
    from fastvideo_pan2_ext.fastvideo_integration import stages

    monkeypatch.setattr(stages, "USER_HEADER", "<|im_start|>system\n")  # the system message becomes condition


def _mutate_system_message(monkeypatch, pipeline):
    from fastvideo_pan2_ext.fastvideo_integration import stages

    monkeypatch.setattr(stages, "SYSTEM_MESSAGE", "You are a helpful assistant.")


def _mutate_first_frame_crop(monkeypatch, pipeline):
    from PIL import Image

    from fastvideo_pan2_ext.media import image

    def floor_crop(img, height, width):  # Wan's centre crop: offsets floored
        cover_w, cover_h = image.cover_size(*img.size, height, width)
        left, top = (cover_w - width) // 2, (cover_h - height) // 2
        resized = img.resize((cover_w, cover_h), Image.LANCZOS).crop((left, top, left + width, top + height))
        pixels = torch.from_numpy(__import__("numpy").asarray(resized, dtype="float32") / 255.0)
        return (2.0 * pixels - 1.0).permute(2, 0, 1)[None, :, None].contiguous()

    from fastvideo_pan2_ext.fastvideo_integration import stages

    monkeypatch.setattr(stages, "first_frame_from_image", floor_crop)


def _mutate_exif(monkeypatch, pipeline):
    from fastvideo_pan2_ext.media import image
    from fastvideo_pan2_ext.fastvideo_integration import stages

    monkeypatch.setattr(stages, "load_image", lambda path: image.load_image(path, exif_transpose=True))


def _mutate_shift(monkeypatch, pipeline):
    scheduler = pipeline.get_module("scheduler")
    monkeypatch.setattr(scheduler, "_shift", 5.0)


def _mutate_timestep_scale(monkeypatch, pipeline):
    dit = pipeline.get_module("transformer")
    forward = dit.forward
    monkeypatch.setattr(dit, "forward", lambda *a, timestep, **k: forward(*a, timestep=timestep / 1000, **k))


MUTATIONS = {
    "rope-neox": ("t2v", _mutate_rope_to_neox),
    "hidden-layer-minus-2": ("t2v", _mutate_hidden_layer),
    "template-crop-at-system": ("t2v", _mutate_template_crop),
    "system-message": ("t2v", _mutate_system_message),
    "first-frame-floor-crop": ("i2v-exif", _mutate_first_frame_crop),
    "exif-transpose": ("i2v-exif", _mutate_exif),
    "shift-5": ("t2v", _mutate_shift),
    "timestep-not-x1000": ("t2v", _mutate_timestep_scale),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_breaking_a_rule_breaks_the_agreement(pipelines, tiny_ckpt, tmp_path, monkeypatch, mutation):
    """Each rule, broken in the product alone, moves the final latents 50x beyond the fp32 agreement's tolerance."""
    case, mutate = MUTATIONS[mutation]
    pipeline, args = pipelines["fp32"]
    kwargs = _case(case, tmp_path)
    want = reference_latents(tiny_ckpt, **kwargs)[-1][0]
    with monkeypatch.context() as patch:
        mutate(patch, pipeline)
        got = run_pipeline(pipeline, args, tiny_ckpt, **kwargs)[-1]
    assert (got - want).abs().max().item() > 1e-3 * want.abs().max().item()
