"""Kept latents reproduce the video (docs/design/outputs.md, "Kept latents and the decode command"): for a checkpoint
given as a hub id and a bf16 VAE, the file records the hub id, the commit FastVideo loaded and the VAE's dtype, and the
decode command the failure line prints, run exactly as printed in a new process, makes bit for bit the video the failed
decode would have made.

The hub is a local Hugging Face cache laid out as huggingface_hub lays it out (`models--org--name/refs/main`,
`snapshots/<commit>/...`) holding the tiny PAN2 checkpoint, read offline. The failure is injected from the test: in
this process by wrapping `WanVAEDecoder.decode` (it decodes, records the video, then raises); the command's video is
recorded by a `sitecustomize` on its PYTHONPATH (`_pan2_helpers.DECODE_HOOK`).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import pytest
import torch
from _pan2_helpers import decode_hook_env, forward_batch, pan2_fast_decode

HUB_ID = "pan2-org/pan2-tiny"
COMMIT = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # a hub commit id: 40 hex digits
LATENTS = torch.randn(1, 48, 3, 3, 5, generator=torch.Generator().manual_seed(17))  # 9 frames of 48 x 80

def _hub_cache(root, checkpoint):
    """A Hugging Face cache holding `checkpoint` as HUB_ID at COMMIT, its main branch pointing there."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


@pytest.mark.slow
def test_a_hub_checkpoint_with_a_bf16_vae_is_decoded_again_bit_for_bit(pan2, tiny_ckpt, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from fastvideo_pan2_ext.media import latents_file
    from fastvideo_pan2_ext.fastvideo_integration import decode_failure, kept_latents
    from fastvideo_pan2_ext.vae_kernel import decoder as decoder_module

    cache = _hub_cache(tmp_path / "hub", tiny_ckpt)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    job_video = []
    original_decode = decoder_module.WanVAEDecoder.decode

    def decode_then_fail(self, z):
        job_video.append(original_decode(self, z))  # the video the job would have made
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(decoder_module.WanVAEDecoder, "decode", decode_then_fail)
    pipeline, args = pan2
    stage = pipeline._stage_name_mapping["decoding_stage"]
    # The VAE as FastVideo loads it for vae_precision bf16 (its config, which the switches below set, shared).
    bf16_vae = copy.deepcopy(stage.vae, memo={id(stage.vae.config): stage.vae.config}).to(torch.bfloat16)
    monkeypatch.setattr(stage, "vae", bf16_vae)
    monkeypatch.setattr(args, "model_path", HUB_ID)  # as FastVideo keeps a hub id (it loads the snapshot's files)
    with pan2_fast_decode(args.pipeline_config):
        batch = forward_batch(args, tiny_ckpt, prompt="x", fps=24)
        batch.latents = LATENTS.clone()
        batch.extra[decode_failure.REQUEST_KEY] = decode_failure.KeepLatentsRequest.beside(tmp_path / "clip.mp4", 24)
        batch = stage(batch, args)

    kept_path = tmp_path / "clip.latents.safetensors"
    assert batch.extra[decode_failure.FAILURE_KEY].latents == str(kept_path), batch.extra[decode_failure.FAILURE_KEY]
    assert len(job_video) == 1 and job_video[0].dtype == torch.bfloat16

    with pytest.raises(decode_failure.DecodeFailed) as failed:
        kept_latents.check_output(batch)  # the parent's line
    line = str(failed.value)
    _, _, command = line.partition("; make the video with: ")
    assert command == latents_file.decode_command(kept_path), line

    recorded = tmp_path / "command-video.pt"
    env = {**os.environ, **decode_hook_env(tmp_path, f"record:{recorded}"), "HF_HUB_CACHE": str(cache)}
    proc = subprocess.run(command, shell=True, cwd=tmp_path / "hook", env=env, capture_output=True, text=True,
                          timeout=600)  # pasted
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"wrote 9 frames to {tmp_path / 'clip.mp4'}" in proc.stdout
    assert torch.equal(torch.load(recorded)["video"], job_video[0])
    kept = latents_file.read(kept_path)  # what made it so
    assert (kept.vae, kept.vae_revision, kept.vae_dtype) == (HUB_ID, COMMIT, "bfloat16")


def test_a_hub_revision_is_recorded_as_the_commit_the_cache_resolves_it_to(pan2, tiny_ckpt, tmp_path, monkeypatch):
    """`main` (FastVideo's default) resolves to the commit of the snapshot FastVideo read; a hub checkpoint that is
    not in the default cache (FastVideo given another place) keeps its latents with the revision as given."""
    import huggingface_hub.constants

    from fastvideo_pan2_ext.fastvideo_integration import kept_latents

    _, args = pan2
    monkeypatch.setattr(args, "model_path", HUB_ID)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", tiny_ckpt)))
    assert kept_latents._vae_source(args) == (HUB_ID, COMMIT)
    monkeypatch.setattr(args, "revision", "v1.0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert kept_latents._vae_source(args) == (HUB_ID, "v1.0")
    monkeypatch.setattr(args, "model_path", str(tiny_ckpt))
    assert kept_latents._vae_source(args) == (str(tiny_ckpt), None)
