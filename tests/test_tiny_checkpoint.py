"""`python -m fastvideo_pan2_ext.demo.tiny_checkpoints OUT_DIR`: a PAN2 checkpoint made offline from the real
component classes.
(FastVideo's own loaders reading it is proven by the in-process and e2e tests, which build pipelines from it.)"""

from __future__ import annotations

import json
import sys

from _pan2_helpers import run
from safetensors.torch import load_file

from fastvideo_pan2_ext.integration.checkpoint import check_pan2_checkpoint
from fastvideo_pan2_ext.configs import PIPELINE_CLASS_NAME
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config


def test_tiny_checkpoint_has_the_diffusers_layout_fastvideo_reads(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINE_CLASS_NAME
    assert index["expand_timesteps"] is True
    assert {k: v for k, v in index.items() if isinstance(v, list) and v[0]} == {
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"]}
    for name in ("scheduler/scheduler_config.json", "tokenizer/tokenizer.json", "text_encoder/config.json",
                 "transformer/config.json", "vae/config.json"):
        assert (tiny_ckpt / name).is_file(), name
    check_pan2_checkpoint(tiny_ckpt)


def test_tiny_vae_is_the_wan22_layout(tiny_ckpt):
    config = json.loads((tiny_ckpt / "vae" / "config.json").read_text())
    assert (config["is_residual"], config["patch_size"], config["z_dim"], config["in_channels"]) == (True, 2, 48, 12)
    assert len(config["latents_mean"]) == len(config["latents_std"]) == 48
    assert len(set(config["latents_std"])) > 1  # non-trivial de-normalization
    decoder = infer_config(load_file(tiny_ckpt / "vae" / "diffusion_pytorch_model.safetensors"))
    assert (decoder.z_dim, decoder.patch_size, decoder.out_channels, sum(decoder.temperal_upsample)) == (48, 2, 12, 2)


def test_tiny_tokenizer_was_trained_locally_and_loads_offline(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt / "tokenizer", local_files_only=True)
    ids = tokenizer("a cat walks across the kitchen")["input_ids"]
    assert tokenizer.unk_token_id not in ids and max(ids) < tokenizer.vocab_size


def test_tiny_cli_rejects_a_file_as_out_dir(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(target)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: OUT_DIR must be a folder; {str(target)!r} is a file"
