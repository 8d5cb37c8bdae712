"""What counts as a PAN2 checkpoint, for FastVideo's model detection and for `--pipeline pan2`'s input check.

A PAN2 checkpoint is a diffusers-layout folder of a Wan2.2-TI2V-5B-class model. FastVideo picks a pipeline config
for a folder by its name or its `model_index.json` class name, so PAN2 is recognised by either of:
- `model_index.json` names `PAN2Pipeline` as its class (what `demo.tiny_checkpoints` writes), or
- the folder's own name contains "pan2" (as FastVideo's detectors match e.g. "lucy-edit" or "turbodiffusion").

`check_pan2_checkpoint` is the stricter check `--pipeline pan2` runs before anything loads: the folder must hold the
components PAN2 runs with, in the Wan2.2 TI2V layout (48-channel-class latents shared by DiT and VAE, patchified
residual Wan2.2 VAE, timestep expansion). Any failure is one line naming the folder and what is wrong.
"""

from __future__ import annotations

import json
import os

from fastvideo_pan2_ext.names import PIPELINE_CLASS_NAME

REQUIRED_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


class NotPAN2CheckpointError(ValueError):
    """A model folder that PAN2 cannot run, with a one-line reason."""


def looks_like_pan2(path_or_class_name: str) -> bool:
    """FastVideo model detector: a model path or a model_index class name (FastVideo passes both, lower-cased)."""
    text = str(path_or_class_name).lower().rstrip("/\\")
    if text == PIPELINE_CLASS_NAME.lower():
        return True
    return "pan2" in os.path.basename(text)


def _read_json(path: str, folder: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: missing {os.path.relpath(path, folder)}") from None
    except (OSError, ValueError) as exc:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: cannot read "
                                     f"{os.path.relpath(path, folder)} ({exc})") from None
    if not isinstance(data, dict):
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: {os.path.relpath(path, folder)} is not a JSON object")
    return data


def check_pan2_checkpoint(folder) -> dict:
    """Raise NotPAN2CheckpointError unless `folder` is a local PAN2 checkpoint; returns its model_index.json."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise NotPAN2CheckpointError(f"model path {folder!r} is not a folder (PAN2 needs a local checkpoint folder)")
    index = _read_json(os.path.join(folder, "model_index.json"), folder)
    missing = [name for name in REQUIRED_COMPONENTS if not os.path.isdir(os.path.join(folder, name))]
    if missing:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: missing component folder(s) {missing}")
    class_name = str(index.get("_class_name", ""))
    if not (looks_like_pan2(class_name) or looks_like_pan2(folder)):
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: model_index.json _class_name is {class_name!r} (expected "
            f"{PIPELINE_CLASS_NAME!r}) and the folder name does not contain 'pan2'")
    if index.get("expand_timesteps") is not True:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: model_index.json must set "
                                     f"expand_timesteps: true (Wan2.2 TI2V); got {index.get('expand_timesteps')!r}")
    vae = _read_json(os.path.join(folder, "vae", "config.json"), folder)
    if not (vae.get("is_residual") is True and vae.get("patch_size") == 2):
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: vae/config.json is not a Wan2.2 VAE (needs is_residual: true, "
            f"patch_size: 2; got {vae.get('is_residual')!r}, {vae.get('patch_size')!r})")
    dit = _read_json(os.path.join(folder, "transformer", "config.json"), folder)
    z_dim = vae.get("z_dim")
    if dit.get("in_channels") != z_dim or dit.get("out_channels") != z_dim:
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: transformer in/out channels "
            f"{dit.get('in_channels')!r}/{dit.get('out_channels')!r} do not match the VAE's z_dim {z_dim!r}")
    return index
