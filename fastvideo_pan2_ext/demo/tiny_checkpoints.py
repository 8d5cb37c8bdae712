"""Tiny local checkpoints: the real component classes at toy widths, seeded random weights, no network.

    python -m fastvideo_pan2_ext.demo.tiny_checkpoints OUT_DIR [--seed 0] [--layout pan2|wan2.2-ti2v|wan2.1-t2v]

Layouts: `pan2` (the default: PAN2, described below), `wan2.2-ti2v` (the same components as a stock
Wan2.2-TI2V-5B checkpoint: `model_index.json` names `WanPipeline`; FastVideo matches a local folder to its config by
the folder's name, so name it `Wan2.2-TI2V-5B-Diffusers`), `wan2.1-t2v` (a stock Wan2.1 T2V checkpoint: 16-channel
latents, the Wan2.1 VAE without patchify at 8x spatial compression, no timestep expansion; name the folder
`Wan2.1-T2V-1.3B-Diffusers`).

The folder has the diffusers layout FastVideo's own loaders read (`model_index.json`, `transformer/`, `vae/`,
`text_encoder/`, `tokenizer/`, `scheduler/scheduler_config.json`):

- transformer: diffusers `WanTransformer3DModel` with Wan2.2-TI2V-5B's shape rules (48 latent channels in and out,
  patch (1, 2, 2)) but 2 heads x 16 and one block;
- vae: diffusers `AutoencoderKLWan` in the Wan2.2 layout (`is_residual`, `patch_size=2`, 12 pixel channels, 16x
  spatial / 4x temporal compression, z_dim 48) at base width 8, with non-trivial `latents_mean`/`latents_std` so the
  pipeline's de-normalization is exercised;
- text_encoder: transformers `UMT5EncoderModel` with d_model 32, one layer;
- tokenizer: a fast tokenizer trained here on a small built-in corpus (nothing is downloaded);
- scheduler: Wan2.2-TI2V-5B's `UniPCMultistepScheduler` config (flow prediction).

`model_index.json` names `PAN2Pipeline` as its class, which is how FastVideo (with this plugin) recognises it. The
checkpoint is only for tests and the demo: its videos are noise-like by design.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from fastvideo_pan2_ext.names import PIPELINE_CLASS_NAME

LATENT_CHANNELS = 48  # PAN2 = Wan2.2-TI2V-5B class: 48-channel latents
TEXT_DIM = 32
LAYOUTS = ("pan2", "wan2.2-ti2v", "wan2.1-t2v")

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


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


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


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, layout: str = "pan2") -> Path:
    """Write a tiny checkpoint of `layout` into `out_dir` (created; an existing checkpoint there is overwritten)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR must be a folder; {str(out)!r} is a file")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    wan21 = layout == "wan2.1-t2v"
    latent_channels = 16 if wan21 else LATENT_CHANNELS
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
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
        "_class_name": PIPELINE_CLASS_NAME if layout == "pan2" else "WanPipeline",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastvideo_pan2_ext.demo.tiny_checkpoints",
                                     description="Write a tiny random-weight checkpoint for tests and demos.")
    parser.add_argument("out_dir", help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random weight (default 0)")
    parser.add_argument("--layout", choices=LAYOUTS, default="pan2", help="which model's layout (default pan2)")
    args = parser.parse_args(argv)
    try:
        out = make_tiny_checkpoint(args.out_dir, seed=args.seed, layout=args.layout)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
