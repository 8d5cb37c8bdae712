"""Tiny local checkpoints: the real component classes at toy widths, seeded random weights, no network.

    python -m fastvideo_pan2_ext.demo.tiny_checkpoints OUT_DIR [--seed 0] [--layout pan2|wan2.2-ti2v|wan2.1-t2v]
                                                       [--index modular|plain|both]

The last line printed is the folder written. Layouts:

`pan2` (the default): IFM/PAN2's public layout (/work/shared/research/pan2-model.md, section 1) in small, every
component of the class the real checkpoint ships, loadable offline with those classes:

- `modular_model_index.json` (`--index modular`, the default): a Modular Diffusers manifest, `_class_name`
  `PAN2ModularPipeline`, one `[library, class, loading spec]` entry per component. The form is the one diffusers'
  `ModularPipeline.save_pretrained` writes after `load_components()` (diffusers 0.42
  `modular_pipelines/modular_pipeline.py`: `register_components` fills the first two slots with the loaded
  component's library and class, `_component_spec_to_dict` the spec `{pretrained_model_name_or_path, revision,
  subfolder, type_hint, variant}`), with `pretrained_model_name_or_path` the hub repo (`IFM/PAN2`) as a pushed
  repo's index has it: diffusers (0.42) loads each component from the local folder when its files are there
  (`_is_local_component`), FastVideo reads the first two slots. `_blocks_class_name` (`PAN2AutoBlocks`, diffusers'
  naming for a pipeline that picks text- or image-to-video by its inputs) is an assumption: no public copy of the
  real manifest was reachable. `--index plain` writes a diffusers `model_index.json` (`PAN2Pipeline`, `[library,
  class]` entries) instead, `--index both` writes both (FastVideo reads `model_index.json` first).
- `transformer/`: `config.json` (`PAN2TransformerConfig(...).to_json()`, `tiny_pan2_transformer_config`: 2 heads x
  16 (inner 32), RoPE axes (4, 6, 6), 2 joint blocks, 1 refiner block, text width 40, the real MLP ratios) and
  `diffusion_pytorch_model.safetensors` holding exactly `weight_shapes`' names and shapes, the joint blocks' AdaLN
  `norm1.linear` in fp32 and the rest in bf16, as IFM ships them. The weights are scaled so that every input and
  rule shows in the output (the timestep across sigma*1000 in [0, 1000], the prompt, the first-frame condition, RoPE
  and its interleaving and temporal scale, the modulation chunk order, the constant text modulation table, the
  refiner's SwiGLU halves, norm_out's scale-then-shift, the unpatchify order) while the output stays O(1) and finite
  over a 50-step sampler (see `_pan2_transformer_weights`).
- `text_encoder/`: transformers `Qwen3_5TextModel` (`architectures: ["Qwen3_5TextModel"]`, bf16 safetensors) with
  hidden size 40 (the transformer's `text_embed_dim`) and 8 layers in Qwen3.5's layout (every 4th full attention,
  the rest Gated-DeltaNet linear attention, so `hidden_states[-3]` is a linear-attention layer's output as in the
  9B), weights scaled so that each layer changes its input substantially and the system message reaches the prompt
  tokens through causal attention (see `_fill_text_encoder`).
- `tokenizer/`: `Qwen3_5Tokenizer`, a byte-level BPE trained here on a built-in corpus with Qwen3.5's pre-tokenizer,
  the ChatML specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and the added `<think>`, `</think>`, and a
  Qwen3.5-style `chat_template` (`QWEN3_5_CHAT_TEMPLATE`).
- `vae/`: diffusers `AutoencoderKLWan` in the Wan2.2 layout (z_dim 48, 16x spatial / 4x temporal) at base width 8,
  fp32, with non-trivial `latents_mean`/`latents_std`.
- `scheduler/scheduler_config.json`: what diffusers' `FlowMatchEulerDiscreteScheduler(shift=9.0).save_config`
  writes (IFM's sampler shifts by 9).

`wan2.2-ti2v`: a stock Wan2.2-TI2V-5B checkpoint (`model_index.json` names `WanPipeline`; FastVideo matches a local
folder to its config by the folder's name, so name it `Wan2.2-TI2V-5B-Diffusers`). `wan2.1-t2v`: a stock Wan2.1 T2V
checkpoint (16-channel latents, the Wan2.1 VAE without patchify at 8x spatial compression, no timestep expansion;
name the folder `Wan2.1-T2V-1.3B-Diffusers`). Both have diffusers' `WanTransformer3DModel` (2 heads x 16, one block),
the Wan VAE at base width 8, a one-layer `UMT5EncoderModel` (d_model 32) with a WordPiece tokenizer trained here, and
Wan's `UniPCMultistepScheduler` config.

The checkpoints are only for tests and demos: their videos are noise-like by design.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from fastvideo_pan2_ext.model.architecture import (TEXT_ENCODER_CLASS_NAME, TRANSFORMER_CLASS_NAME,
                                                  PAN2TransformerConfig, stored_in_fp32, weight_shapes)
from fastvideo_pan2_ext.names import HUB_ID, MODULAR_PIPELINE_CLASS_NAME, PIPELINE_CLASS_NAME

LATENT_CHANNELS = 48  # Wan2.2's z_dim (PAN2 and Wan2.2-TI2V-5B)
TEXT_DIM = 32  # the Wan layouts' UMT5 width
LAYOUTS = ("pan2", "wan2.2-ti2v", "wan2.1-t2v")
INDEX_FORMS = ("modular", "plain", "both")

MODULAR_BLOCKS_CLASS_NAME = "PAN2AutoBlocks"  # `_blocks_class_name`: assumed (see the module docstring)
TOKENIZER_CLASS_NAME = "Qwen3_5Tokenizer"  # what transformers 5 loads Qwen3.5's tokenizer as
PAN2_TEXT_HIDDEN = 40  # the tiny Qwen3.5's hidden size = the tiny transformer's text_embed_dim
PAN2_TEXT_LAYERS = 8  # two of Qwen3.5's (3 x linear attention, 1 x full attention) groups
PAN2_SCHEDULER_SHIFT = 9.0
# Component -> (library, class) in the manifests, in diffusers' (sorted) order.
PAN2_COMPONENTS = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", TEXT_ENCODER_CLASS_NAME),
    "tokenizer": ("transformers", TOKENIZER_CLASS_NAME),
    "transformer": ("diffusers", TRANSFORMER_CLASS_NAME),
    "vae": ("diffusers", "AutoencoderKLWan"),
}
# Qwen's ChatML specials, in Qwen's id order after the BPE vocabulary, and the thinking tags (added, not special).
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINKING_TAGS = ("<think>", "</think>")

_CORPUS = """\
a cat walks across a sunlit kitchen floor and looks at the camera
waves roll onto a sandy beach at sunset while birds fly overhead
a red car drives along a winding mountain road in the rain
the camera slowly pans across a city skyline at night with bright lights
a dog runs through a field of tall green grass chasing a ball
snow falls gently on a quiet forest path lined with pine trees
a person pours coffee into a white cup on a wooden table
clouds drift over green hills as the wind moves the flowers
""".split("\n")

# Also for the PAN2 tokenizer: chat roles, PAN2's system message, a prompt as vLLM-Omni's tests write them.
_CHAT_CORPUS = _CORPUS + """\
system
user
assistant
You are a helpful assistant. Generate the video with the following instructions.
A red fox trots through fresh snow in a pine forest at dawn.
blurry, low quality, distorted, static, overexposed, worst quality, 24 fps, 10 seconds, 704x1248.
The camera follows a cyclist down a street; people wave (slowly) and a bus passes by!
""".split("\n")

# Qwen3.5's chat template, its text path (system, user, assistant, tool turns; no tools schema, no images): each
# message's content is trimmed; an assistant turn after the last user query carries its reasoning in a think block;
# the generation prompt is "<|im_start|>assistant\n" then "<think>\n" (thinking on by default) or, with
# `enable_thinking=False`, the empty block "<think>\n\n</think>\n\n". That is the generation-prompt branch of the
# Qwen3.5 / 3.6 template as public copies of it read (secondary sources describe the larger Qwen3.5 sizes as
# thinking by default, while Qwen3.5-0.8B's card says it does not); no copy of the 9B's own file was reachable.
QWEN3_5_CHAT_TEMPLATE = r"""{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('This tokenizer renders text content only.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- raise_exception('This tokenizer does not render tools.') }}
{%- endif %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set content = render_content(messages[0].content)|trim %}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


def _seeded_fill(module, generator, gamma_jitter: float = 0.1) -> None:
    """Replace every parameter with seeded random values of a sensible scale (norm gains around 1)."""
    import torch

    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() <= 1 or name.endswith(("gamma", "norm.weight", "scale_shift_table")) or ".norm" in name:
                if "bias" in name:
                    values = 0.02 * torch.randn(p.shape, generator=generator)
                elif "scale_shift_table" in name:
                    values = 0.1 * torch.randn(p.shape, generator=generator)
                else:
                    values = 1.0 + gamma_jitter * torch.randn(p.shape, generator=generator)
            else:
                fan_in = p[0].numel()
                values = torch.randn(p.shape, generator=generator) / math.sqrt(fan_in)
            p.copy_(values.to(p.dtype))


def _write_json(path: Path, data: dict, sort_keys: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def _make_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # T5's special-token ids: pad 0, eos 1, unk 2.
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=256, special_tokens=["<pad>", "</s>", "<unk>"],
                                       show_progress=False)  # its bars print blank lines into a log
    tok.train_from_iterator([line for line in _CORPUS if line], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)
    fast.save_pretrained(out / "tokenizer")
    return tok.get_vocab_size()


@contextlib.contextmanager
def _no_transformers_bar():
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _make_wan_vae(out: Path, generator, latent_channels: int, wan21: bool):
    """The tiny Wan VAE (Wan2.2 layout unless `wan21`) at base width 8, saved under `out/vae` (fp32)."""
    import torch
    from diffusers import AutoencoderKLWan

    latents_mean = (0.1 * torch.randn(latent_channels, generator=generator)).tolist()
    latents_std = (1.0 + 0.2 * torch.rand(latent_channels, generator=generator)).tolist()
    layout_args = (dict(is_residual=False, scale_factor_spatial=8) if wan21 else
                   dict(decoder_base_dim=8, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                        scale_factor_spatial=16))
    vae = AutoencoderKLWan(base_dim=8, z_dim=latent_channels, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           temperal_downsample=[False, True, True], scale_factor_temporal=4,
                           latents_mean=latents_mean, latents_std=latents_std, **layout_args)
    _seeded_fill(vae, generator)
    vae.save_pretrained(out / "vae", safe_serialization=True)
    return vae


def _make_wan_checkpoint(out: Path, seed: int, wan21: bool) -> Path:
    """The stock Wan layouts (`wan2.2-ti2v`, `wan2.1-t2v`): unchanged, draw for draw."""
    latent_channels = 16 if wan21 else LATENT_CHANNELS
    import torch
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    vocab_size = _make_tokenizer(out)

    text_config = UMT5Config(vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                             relative_attention_num_buckets=8, relative_attention_max_distance=32,
                             feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    text_encoder = UMT5EncoderModel(text_config)
    _seeded_fill(text_encoder, generator)
    with _no_transformers_bar():  # its "Writing model shards" bar, for one tiny shard, says nothing
        text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)

    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                        in_channels=latent_channels, out_channels=latent_channels, text_dim=TEXT_DIM,
                                        freq_dim=32, ffn_dim=64, num_layers=1, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    _seeded_fill(transformer, generator)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)

    _make_wan_vae(out, generator, latent_channels, wan21)

    # Written out rather than saved from diffusers' class: these are the keys Wan2.2-TI2V-5B-Diffusers ships, which
    # FastVideo's own UniPC scheduler accepts (newer diffusers versions add keys it does not).
    _write_json(out / "scheduler" / "scheduler_config.json", {
        "_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
        "disable_corrector": [], "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 5.0,
        "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True,
        "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False, "sample_max_value": 1.0,
        "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0, "thresholding": False,
        **({"flow_shift": 3.0} if wan21 else {}),
        "timestep_spacing": "linspace", "trained_betas": None, "use_beta_sigmas": False,
        "use_exponential_sigmas": False, "use_flow_sigmas": True, "use_karras_sigmas": False,
    })

    import diffusers

    _write_json(out / "model_index.json", {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": None,
        "expand_timesteps": not wan21,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    })
    return out


# --------------------------------------------------------------------------------------------------------------------
# PAN2's public layout
# --------------------------------------------------------------------------------------------------------------------


def _generator(seed: int, component: int):
    """One generator per PAN2 component, so that each component's weights depend on the seed alone."""
    import torch

    return torch.Generator().manual_seed(seed * 16 + component)


def tiny_pan2_transformer_config() -> PAN2TransformerConfig:
    """The tiny transformer: every rule of the real config at toy widths. 2 heads x 16 (inner 32, not the text width
    40, nor the 48 latent channels), RoPE axes (4, 6, 6) (t, h, w; summing to the head dim), 2 joint blocks, 1
    refiner block, the real MLP ratios (8, 4, 4), patch (1, 2, 2), 97 input channels, rope_theta 256, t x 16/24."""
    return PAN2TransformerConfig(num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                                 text_embed_dim=PAN2_TEXT_HIDDEN, rope_axes_dim=(4, 6, 6))


# The transformer's weight scales. Matrices are N(0, 1) * gain / sqrt(fan_in); norm gains 1 + N(0, 0.1).
_JOINT_QK_GAIN = 2.0  # the joint blocks' video q/k RMSNorm gains: logits of std ~4, so RoPE moves the attention
_JOINT_TEXT_QK_GAIN = 2.5  # their text q/k gains: the 10-odd text tokens hold their own against the video tokens
_ADALN_GAIN = 2.0  # norm1.linear and norm_out.linear: modulation O(0.5) that varies with the timestep
_ADALN_BIAS = 0.3  # their biases: gates away from zero at every timestep
_REFINER_FF_GAIN = 1.5  # the refiner's SwiGLU: its two halves' roles show in the output
_PROJ_OUT_GAIN = 0.5  # the velocity comes out O(1)
_TABLE_STD = 0.5  # scale_shift_table_context and context_type_embedding
_BIAS_STD = 0.1


def _pan2_transformer_weights(config: PAN2TransformerConfig, generator) -> dict:
    """Seeded fp32 weights for every `weight_shapes` name, scaled so that each input and rule of the model shows in
    its output while the output stays O(1). Measured for seed 0 with a plain forward written from the research notes'
    section 2 (relative change of the velocity; 3 x 4 x 6 video tokens, 12 text tokens, timestep 500; output RMS
    0.57): timestep 0 / 1000 / sigma not x 1000: 0.93 / 0.88 / 0.94; another prompt: 0.46; a first-frame condition:
    0.52; RoPE off: 0.44, neox instead of interleaved: 0.52, t x 1 instead of x 16/24: 0.13; the AdaLN chunks shift
    <-> scale: 0.85; the text modulation from temb instead of its table: 0.36; the refiner's SwiGLU halves swapped:
    0.30; norm_out shift first: 0.73; Wan's unpatchify order: 1.43; bf16 against fp32: 0.014 (seeds 1-4 alike). A
    50-step shift-9 Euler sampler in fp32 latents, guidance 1 or 3, stays finite and O(1) (RMS 1.1, max |x| 5)."""
    import torch

    weights = {}
    for name, shape in weight_shapes(config).items():
        r = torch.randn(shape, generator=generator)
        joint = name.startswith("transformer_blocks.")
        if name == "context_type_embedding" or name.endswith("scale_shift_table_context"):
            value = _TABLE_STD * r
        elif name.endswith(("attn.norm_q.weight", "attn.norm_k.weight")):
            value = (_JOINT_QK_GAIN if joint else 1.0) + 0.1 * r
        elif name.endswith(("attn.norm_added_q.weight", "attn.norm_added_k.weight")):
            value = _JOINT_TEXT_QK_GAIN + 0.1 * r
        elif len(shape) == 1 and name.endswith("weight"):  # RMSNorm gains
            value = 1.0 + 0.1 * r
        elif name.endswith("bias"):
            value = (_ADALN_BIAS if ".norm1.linear." in name or name.startswith("norm_out.") else _BIAS_STD) * r
        else:
            if ".norm1.linear." in name or name.startswith("norm_out."):
                gain = _ADALN_GAIN
            elif name.startswith("context_refiner.") and ".ff." in name:
                gain = _REFINER_FF_GAIN
            elif name.startswith("proj_out."):
                gain = _PROJ_OUT_GAIN
            else:
                gain = 1.0
            value = gain * r / math.sqrt(math.prod(shape[1:]))
        weights[name] = value
    return weights


def make_pan2_transformer(folder: str | Path | None, seed: int = 0) -> dict:
    """The tiny transformer's state dict as stored (`stored_in_fp32` names fp32, the rest bf16); written as
    `config.json` and `diffusion_pytorch_model.safetensors` into `folder` unless it is None."""
    import torch

    config = tiny_pan2_transformer_config()
    weights = {name: value.to(torch.float32 if stored_in_fp32(name) else torch.bfloat16).contiguous()
               for name, value in _pan2_transformer_weights(config, _generator(seed, 1)).items()}
    if folder is not None:
        import diffusers
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / "config.json", {**config.to_json(), "_diffusers_version": diffusers.__version__},
                    sort_keys=True)
        save_file(weights, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    return weights


def make_pan2_tokenizer(folder: str | Path | None):
    """Qwen3.5's tokenizer class over a byte-level BPE trained here (`_CHAT_CORPUS`, Qwen3.5's pre-tokenizer and NFC
    normalizer, so any text tokenizes), with the ChatML specials after the BPE vocabulary, then `<think>` and
    `</think>`, and `QWEN3_5_CHAT_TEMPLATE`. Saved with `save_pretrained` into `folder` unless it is None (then
    `AutoTokenizer.from_pretrained(folder)` loads it offline). Deterministic: no seed."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen3_5Tokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([line for line in _CHAT_CORPUS if line], trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    for token in CHATML_SPECIALS:
        vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", model_max_length=262144)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(list(THINKING_TAGS))
    tokenizer.chat_template = QWEN3_5_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids([*CHATML_SPECIALS, *THINKING_TAGS])
    assert ids == list(range(len(vocab) - len(CHATML_SPECIALS), len(vocab) + len(THINKING_TAGS))), ids
    if folder is not None:
        tokenizer.save_pretrained(str(folder))
    return tokenizer


def pan2_text_encoder_config(vocab_size: int, eos_token_id: int | None = None):
    """The tiny Qwen3.5 text config: hidden 40, 8 layers (linear x3, full, linear x3, full: Qwen3.5's every-4th full
    attention), full attention 2 heads x 16 with 1 KV head (rotary on a quarter of the head, Qwen3.5's MRoPE
    sections scaled down), Gated-DeltaNet 2 key heads and 4 value heads of 8."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=PAN2_TEXT_HIDDEN, intermediate_size=96, num_hidden_layers=PAN2_TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                            "mrope_interleaved": True},
        eos_token_id=eos_token_id, tie_word_embeddings=False)


_TEXT_OUT_GAIN = 1.5  # each layer's output projections: every layer moves the residual stream by ~0.4 of itself
_TEXT_QK_NORM = 0.5  # the full-attention q/k norms (zero-centred: gain 1.5): peaked attention
_TEXT_DECAY = (0.01, 0.2)  # Gated-DeltaNet's A = exp(A_log): slow decay, so linear attention carries the system too


def _fill_text_encoder(model, generator) -> None:
    """Seeded weights for the tiny Qwen3.5: embeddings N(0, 1); matrices N(0, 1) / sqrt(fan_in), the output
    projections (o_proj, down_proj, out_proj) x 1.5; Qwen3.5's zero-centred RMSNorm weights N(0, 0.1) (gains ~1),
    the q/k norms 0.5 + N(0, 0.1); the gated norm's gains 1 + N(0, 0.1); dt_bias 1 + N(0, 0.1); A uniform in
    [0.01, 0.2]. Measured for seed 0 on PAN2's encoding of a 13-word prompt (the 32 conditioned tokens; relative to
    `hidden_states[-3]` there, fp32 and bf16 alike): `[-2]` 0.39, `[-4]` 0.40, `[-1]` 0.75, the embeddings 0.95, the
    system message dropped 0.67 (0.99 for the empty prompt); each layer moves its input by 0.37 to 1.4."""
    import torch

    lo, hi = _TEXT_DECAY
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=generator)
            if name.endswith("A_log"):
                value = torch.log(lo + (hi - lo) * torch.rand(p.shape, generator=generator))
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                value = 1.0 + 0.1 * r
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                value = _TEXT_QK_NORM + 0.1 * r
            elif "norm" in name:
                value = 0.1 * r
            elif name.endswith("embed_tokens.weight"):
                value = r
            else:
                output_projection = name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight"))
                value = (_TEXT_OUT_GAIN if output_projection else 1.0) * r / math.sqrt(p[0].numel())
            p.copy_(value.to(p.dtype))


def make_pan2_text_encoder(folder: str | Path | None, tokenizer, seed: int = 0):
    """The tiny `Qwen3_5TextModel` for `tokenizer` (its vocabulary padded to a multiple of 64, as Qwen pads
    248077 tokens to 248320), seeded, in bf16 as Qwen3.5 ships; saved with `save_pretrained` into `folder` (its
    config.json names `Qwen3_5TextModel`) unless it is None. Returns the model (eval)."""
    import torch
    from transformers import Qwen3_5TextModel

    vocab_size = -(-len(tokenizer) // 64) * 64
    config = pan2_text_encoder_config(vocab_size, eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    model = Qwen3_5TextModel(config).eval()
    _fill_text_encoder(model, _generator(seed, 2))
    model = model.to(torch.bfloat16)
    if folder is not None:
        with _no_transformers_bar():
            model.save_pretrained(str(folder), safe_serialization=True)
    return model


def _modular_index(diffusers_version: str) -> dict:
    index = {"_blocks_class_name": MODULAR_BLOCKS_CLASS_NAME, "_class_name": MODULAR_PIPELINE_CLASS_NAME,
             "_diffusers_version": diffusers_version}
    for name, (library, class_name) in PAN2_COMPONENTS.items():
        index[name] = [library, class_name, {"pretrained_model_name_or_path": HUB_ID, "revision": None,
                                             "subfolder": name, "type_hint": [library, class_name], "variant": None}]
    return index


def _plain_index(diffusers_version: str) -> dict:
    return {"_class_name": PIPELINE_CLASS_NAME, "_diffusers_version": diffusers_version,
            **{name: list(spec) for name, spec in PAN2_COMPONENTS.items()}}


def make_pan2_checkpoint(out_dir: str | Path, seed: int = 0, index: str = "modular") -> Path:
    """Write the tiny checkpoint in IFM/PAN2's public layout into `out_dir` (created; an existing checkpoint there is
    overwritten). `index`: "modular" (modular_model_index.json), "plain" (model_index.json) or "both"."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR must be a folder; {str(out)!r} is a file")
    if index not in INDEX_FORMS:
        raise ValueError(f"index must be one of {', '.join(INDEX_FORMS)}; got {index!r}")
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    out.mkdir(parents=True, exist_ok=True)
    make_pan2_transformer(out / "transformer", seed)
    tokenizer = make_pan2_tokenizer(out / "tokenizer")
    make_pan2_text_encoder(out / "text_encoder", tokenizer, seed)
    _make_wan_vae(out, _generator(seed, 3), LATENT_CHANNELS, wan21=False)
    FlowMatchEulerDiscreteScheduler(shift=PAN2_SCHEDULER_SHIFT).save_config(str(out / "scheduler"))
    for name, wanted in (("modular_model_index.json", index in ("modular", "both")),
                         ("model_index.json", index in ("plain", "both"))):
        if wanted:
            maker = _modular_index if name.startswith("modular") else _plain_index
            _write_json(out / name, maker(diffusers.__version__), sort_keys=True)
        else:
            (out / name).unlink(missing_ok=True)  # an earlier checkpoint's other manifest
    return out


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, layout: str = "pan2", index: str | None = None) -> Path:
    """Write a tiny checkpoint of `layout` into `out_dir` (created; an existing checkpoint there is overwritten).
    `index` (the manifest form) applies to the `pan2` layout only (default "modular")."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR must be a folder; {str(out)!r} is a file")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if layout == "pan2":
        return make_pan2_checkpoint(out, seed=seed, index=index or "modular")
    if index is not None:
        raise ValueError(f"--index applies to the pan2 layout only; {layout} writes model_index.json")
    return _make_wan_checkpoint(out, seed, wan21=layout == "wan2.1-t2v")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastvideo_pan2_ext.demo.tiny_checkpoints",
                                     description="Write a tiny random-weight checkpoint for tests and demos.")
    parser.add_argument("out_dir", help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random weight (default 0)")
    parser.add_argument("--layout", choices=LAYOUTS, default="pan2", help="which model's layout (default pan2)")
    parser.add_argument("--index", choices=INDEX_FORMS, default=None,
                        help="pan2 only: modular_model_index.json (modular, the default), model_index.json (plain) "
                             "or both")
    args = parser.parse_args(argv)
    try:
        out = make_tiny_checkpoint(args.out_dir, seed=args.seed, layout=args.layout, index=args.index)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
