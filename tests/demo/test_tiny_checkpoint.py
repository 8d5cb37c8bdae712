"""`fastvideo_pan2_ext.demo.tiny_checkpoints`: tiny checkpoints made offline from the real component classes.

The `pan2` layout is IFM/PAN2's public one (a Modular Diffusers manifest, `PAN2Transformer3DModel` weights by
`model.architecture`'s names, Qwen3.5's text encoder and tokenizer, the Wan2.2 VAE, a shift-9 flow-match scheduler):
each component loads with the class the real checkpoint names, the tokenizer's template puts PAN2's prompt where
PAN2's prompt encoding looks for it, and the text encoder is sensitive to what PAN2's encoding gets right (the hidden
layer, the system message). The `wan2.2-ti2v` layout is a stock Wan2.2-TI2V-5B one.
(FastVideo's own loaders reading these folders is proven by the pipeline tests, which build pipelines from them.)
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from _pan2_helpers import OFFLINE, run
from safetensors import safe_open
from safetensors.torch import load_file

from fastvideo_pan2_ext.demo import tiny_checkpoints as tc
from fastvideo_pan2_ext.model.architecture import (TEXT_ENCODER_CLASS_NAME, TRANSFORMER_CLASS_NAME,
                                                  PAN2TransformerConfig, stored_in_fp32, weight_shapes)
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config

# PAN2's prompt encoding as its sampler defines it (research notes, section 3; vLLM-Omni's `encode_prompt`), written
# here from the definition rather than imported from the plugin's stage: these tests are about the checkpoint.
SYSTEM_MESSAGE = "You are a helpful assistant. Generate the video with the following instructions."
USER_HEADER = "<|im_start|>user\n"
PROMPT = "A red fox trots through fresh snow in a pine forest at dawn."
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")


def pan2_ids(tokenizer, prompt: str, system: bool = True, **template_kwargs) -> tuple[list[int], int]:
    """The templated ids and the crop start (just after the first user header), cut at crop + 1536."""
    messages = ([{"role": "system", "content": SYSTEM_MESSAGE}] if system else []) + [
        {"role": "user", "content": prompt or " "}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        **template_kwargs)["input_ids"]
    header = tokenizer(USER_HEADER, add_special_tokens=False)["input_ids"]
    crop = next(i + len(header) for i in range(len(ids)) if ids[i:i + len(header)] == header)
    return ids[:crop + 1536], crop


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def pan2_ckpt(tmp_path_factory):
    """The real layout with both manifests, made in this process."""
    return tc.make_pan2_checkpoint(tmp_path_factory.mktemp("ckpt") / "pan2-both", seed=0, index="both")


@pytest.fixture(scope="module")
def pan2_cli_ckpt(tmp_path_factory):
    """The real layout as the CLI writes it by default (the modular manifest only)."""
    target = tmp_path_factory.mktemp("cli") / "pan2"
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(target)], env_extra=OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(target)
    return target


@pytest.fixture(scope="module")
def wan22_ckpt(tmp_path_factory):
    return tc.make_tiny_checkpoint(tmp_path_factory.mktemp("wan") / "Wan2.2-TI2V-5B-Diffusers", layout="wan2.2-ti2v")


@pytest.fixture(scope="module")
def pan2_tokenizer(pan2_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pan2_ckpt / "tokenizer", local_files_only=True)


@pytest.fixture(scope="module")
def pan2_text_encoder(pan2_ckpt):
    from transformers import Qwen3_5TextModel

    return Qwen3_5TextModel.from_pretrained(pan2_ckpt, subfolder="text_encoder", local_files_only=True,
                                            dtype=torch.float32).eval()


# ---- the stock Wan2.2-TI2V-5B layout ----------------------------------------------------------------------------


def test_wan22_ti2v_layout_is_stock_wan(wan22_ckpt):
    index = json.loads((wan22_ckpt / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["expand_timesteps"] is True
    assert {k: v for k, v in index.items() if isinstance(v, list) and v[0]} == {
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"]}
    for name in ("scheduler/scheduler_config.json", "tokenizer/tokenizer.json", "text_encoder/config.json",
                 "transformer/config.json", "vae/config.json"):
        assert (wan22_ckpt / name).is_file(), name
    assert not (wan22_ckpt / "modular_model_index.json").exists()


def test_wan22_tokenizer_was_trained_locally_and_loads_offline(wan22_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wan22_ckpt / "tokenizer", local_files_only=True)
    ids = tokenizer("a cat walks across the kitchen")["input_ids"]
    assert tokenizer.unk_token_id not in ids and max(ids) < tokenizer.vocab_size


@pytest.mark.parametrize("layout", ["pan2", "wan2.2-ti2v"])
def test_tiny_vae_is_the_wan22_layout(layout, pan2_ckpt, wan22_ckpt):
    folder = (pan2_ckpt if layout == "pan2" else wan22_ckpt) / "vae"
    config = json.loads((folder / "config.json").read_text())
    assert (config["is_residual"], config["patch_size"], config["z_dim"], config["in_channels"]) == (True, 2, 48, 12)
    assert (config["scale_factor_spatial"], config["scale_factor_temporal"]) == (16, 4)
    assert len(config["latents_mean"]) == len(config["latents_std"]) == 48
    assert len(set(config["latents_std"])) > 1  # non-trivial de-normalization
    decoder = infer_config(load_file(folder / "diffusion_pytorch_model.safetensors"))
    assert (decoder.z_dim, decoder.patch_size, decoder.out_channels, sum(decoder.temperal_upsample)) == (48, 2, 12, 2)


def test_index_applies_to_pan2_only(tmp_path):
    with pytest.raises(ValueError, match="pan2 layout only"):
        tc.make_tiny_checkpoint(tmp_path / "wan", layout="wan2.2-ti2v", index="plain")
    with pytest.raises(ValueError, match="index must be one of"):
        tc.make_pan2_checkpoint(tmp_path / "pan2", index="sharded")


def test_tiny_cli_rejects_a_file_as_out_dir(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(target)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: OUT_DIR must be a folder; {str(target)!r} is a file"


# ---- PAN2's public layout: manifests -----------------------------------------------------------------------------


@pytest.mark.slow
def test_pan2_cli_writes_the_modular_manifest_by_default(pan2_cli_ckpt):
    assert (pan2_cli_ckpt / "modular_model_index.json").is_file()
    assert not (pan2_cli_ckpt / "model_index.json").exists()
    assert sorted(p.name for p in pan2_cli_ckpt.iterdir() if p.is_dir()) == sorted(COMPONENTS)


def test_pan2_modular_manifest_has_one_loading_spec_per_component(pan2_ckpt):
    import diffusers

    index = json.loads((pan2_ckpt / "modular_model_index.json").read_text())
    assert index["_class_name"] == "PAN2ModularPipeline"
    assert index["_diffusers_version"] == diffusers.__version__
    assert index["_blocks_class_name"]
    expected = {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", TEXT_ENCODER_CLASS_NAME],
                "tokenizer": ["transformers", "Qwen3_5Tokenizer"],
                "transformer": ["diffusers", TRANSFORMER_CLASS_NAME],
                "vae": ["diffusers", "AutoencoderKLWan"]}
    assert {k for k in index if not k.startswith("_")} == set(expected)
    for name, (library, class_name) in expected.items():
        entry = index[name]
        assert entry[:2] == [library, class_name], name  # what FastVideo's loader reads
        assert entry[2] == {"pretrained_model_name_or_path": "IFM/PAN2", "revision": None, "subfolder": name,
                            "type_hint": [library, class_name], "variant": None}, name


def test_pan2_plain_manifest_names_the_same_classes(pan2_ckpt):
    plain = json.loads((pan2_ckpt / "model_index.json").read_text())
    modular = json.loads((pan2_ckpt / "modular_model_index.json").read_text())
    assert plain["_class_name"] == "PAN2Pipeline" and plain["_diffusers_version"] == modular["_diffusers_version"]
    assert {k: v for k, v in plain.items() if not k.startswith("_")} == {
        k: v[:2] for k, v in modular.items() if not k.startswith("_")}


def test_pan2_modular_manifest_loads_with_diffusers_modular_reader(pan2_ckpt):
    """diffusers' own reader: `ModularPipeline` takes each component's loading spec from the manifest, sees its files
    in the folder (not at the hub id the spec names) and loads it with the spec's type hint. The transformer is left
    out: this diffusers has no `PAN2Transformer3DModel` to resolve the type hint to."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, ModularPipeline
    from diffusers.modular_pipelines import ComponentSpec, ModularPipelineBlocks
    from transformers import Qwen3_5TextModel, Qwen3_5Tokenizer

    class Blocks(ModularPipelineBlocks):
        @property
        def expected_components(self):
            return [ComponentSpec("text_encoder", Qwen3_5TextModel), ComponentSpec("tokenizer", Qwen3_5Tokenizer),
                    ComponentSpec("vae", AutoencoderKLWan),
                    ComponentSpec("scheduler", FlowMatchEulerDiscreteScheduler)]

    modular_only = pan2_ckpt.parent / "pan2-modular-view"
    modular_only.mkdir(exist_ok=True)
    for name in COMPONENTS:  # the same files, with the modular manifest alone
        if not (modular_only / name).exists():
            (modular_only / name).symlink_to(pan2_ckpt / name, target_is_directory=True)
    (modular_only / "modular_model_index.json").write_text((pan2_ckpt / "modular_model_index.json").read_text())

    assert ModularPipeline.load_config(modular_only)["_class_name"] == "PAN2ModularPipeline"
    pipe = ModularPipeline(blocks=Blocks(), pretrained_model_name_or_path=str(modular_only))
    for name in ("text_encoder", "tokenizer", "vae", "scheduler"):
        spec = pipe._component_specs[name]
        assert (spec.pretrained_model_name_or_path, spec.subfolder) == (str(modular_only), name), name
    pipe.load_components()
    assert isinstance(pipe.text_encoder, Qwen3_5TextModel)
    assert isinstance(pipe.tokenizer, Qwen3_5Tokenizer)
    assert isinstance(pipe.vae, AutoencoderKLWan) and pipe.vae.config.z_dim == 48
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.scheduler.config.shift == 9.0


def test_pan2_checkpoint_passes_the_plugins_check(pan2_ckpt, pan2_cli_ckpt):
    from fastvideo_pan2_ext.fastvideo_integration.checkpoint import check_pan2_checkpoint

    check_pan2_checkpoint(pan2_cli_ckpt)  # the modular manifest
    check_pan2_checkpoint(pan2_ckpt)  # model_index.json read first


# ---- PAN2's public layout: components ----------------------------------------------------------------------------


def test_pan2_transformer_holds_exactly_weight_shapes_in_the_stored_dtypes(pan2_ckpt):
    import diffusers

    config_json = json.loads((pan2_ckpt / "transformer" / "config.json").read_text())
    config = tc.tiny_pan2_transformer_config()
    assert config_json == {**config.to_json(), "_diffusers_version": diffusers.__version__}
    assert config_json["_class_name"] == TRANSFORMER_CLASS_NAME
    assert PAN2TransformerConfig.from_json(config_json) == config
    # Every rule at toy widths: inner 32 = 2 x 16 heads, text 40, RoPE axes summing to the head dim, a refiner.
    assert (config.inner_dim, config.text_embed_dim, config.rope_axes_dim) == (32, 40, (4, 6, 6))
    assert (config.num_layers, config.num_refiner_layers, config.in_channels, config.out_channels) == (2, 1, 97, 48)

    shapes = weight_shapes(config)
    with safe_open(str(pan2_ckpt / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(shapes)
        for name, shape in shapes.items():
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == shape, name
            assert tensor.dtype == (torch.float32 if stored_in_fp32(name) else torch.bfloat16), name
            assert torch.isfinite(tensor.float()).all() and tensor.float().abs().max() > 0, name
    assert sum(stored_in_fp32(name) for name in shapes) == 2 * config.num_layers  # norm1.linear weight and bias


def test_pan2_transformer_weights_make_modulation_and_rope_count(pan2_ckpt):
    """The scales that make the rules show (the output's sensitivity to them is measured in
    `_pan2_transformer_weights`' docstring): non-zero AdaLN and text tables, peaked joint attention."""
    w = load_file(pan2_ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    for i in range(2):
        p = f"transformer_blocks.{i}."
        table = w[p + "scale_shift_table_context"].float()
        assert table.std() > 0.3 and all(chunk.abs().mean() > 0.2 for chunk in table.chunk(6))
        assert w[p + "norm1.linear.weight"].std() > 0.2 and w[p + "norm1.linear.bias"].std() > 0.1
        assert w[p + "attn.norm_q.weight"].float().mean() > 1.5  # logits of std ~4: RoPE moves the attention
    gains = [w[name].float().mean().item() for name in w if name.endswith(("norm1.weight", "norm2.weight"))]
    assert gains and all(0.8 < g < 1.2 for g in gains)  # the refiner's RMSNorm gains stay around 1
    assert w["norm_out.linear.weight"].std() > 0.2


def test_pan2_checkpoint_is_deterministic_in_its_seed():
    a, b, c = (tc.make_pan2_transformer(None, seed) for seed in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["proj_out.weight"], c["proj_out.weight"])
    t1, t2 = tc.make_pan2_tokenizer(None), tc.make_pan2_tokenizer(None)
    assert t1.backend_tokenizer.to_str() == t2.backend_tokenizer.to_str()


def test_pan2_components_load_with_the_real_classes(pan2_ckpt, pan2_tokenizer, pan2_text_encoder):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    text_config = json.loads((pan2_ckpt / "text_encoder" / "config.json").read_text())
    assert text_config["architectures"] == [TEXT_ENCODER_CLASS_NAME] and text_config["model_type"] == "qwen3_5_text"
    assert text_config["dtype"] == "bfloat16"
    config = pan2_text_encoder.config
    assert config.hidden_size == tc.tiny_pan2_transformer_config().text_embed_dim
    assert config.num_hidden_layers >= 6
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert config.vocab_size % 64 == 0 and config.vocab_size > len(pan2_tokenizer)
    assert config.eos_token_id == pan2_tokenizer.convert_tokens_to_ids("<|endoftext|>")

    assert type(pan2_tokenizer).__name__ == "Qwen3_5Tokenizer"
    vae = AutoencoderKLWan.from_pretrained(pan2_ckpt, subfolder="vae", local_files_only=True)
    assert (vae.config.z_dim, vae.config.scale_factor_spatial, vae.config.scale_factor_temporal) == (48, 16, 4)
    assert vae.dtype == torch.float32

    scheduler_json = json.loads((pan2_ckpt / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler_json["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler_json["shift"] == 9.0
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(pan2_ckpt, subfolder="scheduler",
                                                                local_files_only=True)
    assert scheduler.config.shift == 9.0 and not scheduler.config.use_dynamic_shifting
    scheduler.set_timesteps(sigmas=[1.0, 0.5, 0.1])
    assert torch.allclose(scheduler.sigmas[:3], torch.tensor([1.0, 9 * 0.5 / (1 + 8 * 0.5), 9 * 0.1 / (1 + 8 * 0.1)]))


# ---- the tokenizer's chat template --------------------------------------------------------------------------------


def test_pan2_tokenizer_has_the_chatml_specials_as_single_tokens(pan2_tokenizer):
    tok = pan2_tokenizer
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [token], token
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == list(range(ids[0], ids[0] + 5))  # after the BPE vocabulary, in Qwen's order
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = "Ünïcode, digits 1248 and (punctuation) — all byte-level!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_pan2_template_puts_system_user_header_and_generation_prompt_where_pan2_expects(pan2_tokenizer):
    tok = pan2_tokenizer
    ids, crop = pan2_ids(tok, PROMPT)
    assert tok.decode(ids) == (f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n{PROMPT}"
                               "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    # The user header tokenizes on its own as it does inside the template, so the crop finds it, once.
    header = tok(USER_HEADER, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[:crop]).endswith(USER_HEADER) and tok.decode(ids[:crop]).count(USER_HEADER) == 1
    # What PAN2 conditions on: the prompt, then the assistant header and the generation prompt.
    assert tok.decode(ids[crop:]) == f"{PROMPT}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert ids[crop:][:len(tok(PROMPT, add_special_tokens=False)["input_ids"])] == tok(
        PROMPT, add_special_tokens=False)["input_ids"]
    assert len(header) >= 2 and max(ids) < len(tok)
    # Without the system message the conditioned ids are the same ones.
    ids_no_system, crop_no_system = pan2_ids(tok, PROMPT, system=False)
    assert ids_no_system[crop_no_system:] == ids[crop:] and crop_no_system < crop


def test_pan2_template_handles_enable_thinking_as_qwen35_does(pan2_tokenizer):
    tok = pan2_tokenizer
    default, crop = pan2_ids(tok, PROMPT)
    assert pan2_ids(tok, PROMPT, enable_thinking=True)[0] == default
    off, crop_off = pan2_ids(tok, PROMPT, enable_thinking=False)
    assert crop_off == crop
    assert tok.decode(off[crop:]) == f"{PROMPT}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # Qwen3.5 trims each message: PAN2's empty prompt (" ") becomes an empty user turn.
    empty, crop_empty = pan2_ids(tok, "")
    assert tok.decode(empty[crop_empty:]) == "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    # A conversation renders as ChatML; the last assistant turn after the user query carries its reasoning.
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"}],
        tokenize=False)
    assert rendered == ("<|im_start|>user\nhi<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello<|im_end|>\n")


# ---- the text encoder's sensitivity -------------------------------------------------------------------------------


def test_pan2_text_encoder_hidden_state_minus_3_is_far_from_its_neighbours(pan2_tokenizer, pan2_text_encoder):
    ids, crop = pan2_ids(pan2_tokenizer, PROMPT)
    with torch.no_grad():
        hs = pan2_text_encoder(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(hs) == pan2_text_encoder.config.num_hidden_layers + 1
    embeds = hs[-3][:, crop:]
    assert embeds.shape == (1, len(ids) - crop, tc.tiny_pan2_transformer_config().text_embed_dim)
    assert torch.isfinite(embeds).all() and 0.3 < embeds.pow(2).mean().sqrt() < 30
    # A hidden layer off by one either way, the final-normed output, the embeddings: each far from hidden_states[-3].
    for other in (-2, -4, -1, 0):
        assert relative(hs[other][:, crop:], embeds) > 0.3, other
    # Each layer moves its input substantially.
    for i in range(1, len(hs)):
        assert relative(hs[i][:, crop:], hs[i - 1][:, crop:]) > 0.25, i


@pytest.mark.parametrize("prompt", [PROMPT, ""])
def test_pan2_text_encoder_sees_the_system_message_through_causal_attention(pan2_tokenizer, pan2_text_encoder,
                                                                            prompt):
    ids, crop = pan2_ids(pan2_tokenizer, prompt)
    ids_no_system, crop_no_system = pan2_ids(pan2_tokenizer, prompt, system=False)
    with torch.no_grad():
        embeds = pan2_text_encoder(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-3]
        without = pan2_text_encoder(input_ids=torch.tensor([ids_no_system]),
                                    output_hidden_states=True).hidden_states[-3]
    # The same conditioned tokens, a large change: the system message reaches them only through attention.
    assert relative(without[:, crop_no_system:], embeds[:, crop:]) > 0.3
