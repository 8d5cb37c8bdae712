"""What counts as a PAN2 checkpoint: IFM/PAN2's public layout, recognised by its own files, never its folder's name.

- The manifest: `modular_model_index.json` (Modular Diffusers, what IFM publishes) or `model_index.json`, whose
  `_class_name` is `PAN2ModularPipeline` or `PAN2Pipeline` (`looks_like_pan2`, FastVideo's model detector).
- The components: `transformer/` (`PAN2Transformer3DModel`), `text_encoder/` (`Qwen3_5TextModel`), `tokenizer/`,
  `vae/` (a Wan2.2-layout `AutoencoderKLWan` whose z_dim is the transformer's latent width), `scheduler/`.

`check_pan2_checkpoint` is what every entry point runs before anything loads: one line naming the folder and what is
wrong (`NotPAN2CheckpointError`). A hub id (`IFM/PAN2`) goes through FastVideo's usual download and is checked once
downloaded (`PAN2Pipeline._load_config`). `component_index` turns either manifest into the `{component: [library,
class]}` form FastVideo's loader reads.
"""

from __future__ import annotations

import json
import os

from fastvideo_pan2_ext.model.architecture import (TEXT_ENCODER_CLASS_NAME, TRANSFORMER_CLASS_NAME,
                                                   PAN2TransformerConfig)
from fastvideo_pan2_ext.names import PIPELINE_CLASS_NAME, PIPELINE_CLASS_NAMES

REQUIRED_COMPONENTS = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")
MANIFESTS = ("model_index.json", "modular_model_index.json")  # FastVideo reads the first that exists


class NotPAN2CheckpointError(ValueError):
    """A model folder that PAN2 cannot run, with a one-line reason."""


def looks_like_pan2(class_name: str) -> bool:
    """FastVideo's model detector: a manifest's `_class_name` (FastVideo passes it, and the model path, lower-cased;
    a path never matches)."""
    return str(class_name).lower() in {name.lower() for name in PIPELINE_CLASS_NAMES}


def is_hub_id(model_path) -> bool:
    """`owner/name` that is not a local path: FastVideo downloads it."""
    text = os.fspath(model_path)
    return not os.path.exists(text) and text.count("/") == 1 and not text.startswith((".", "/", "~"))


def component_index(manifest: dict) -> dict:
    """The manifest with every component as `[library, class]`: a Modular Diffusers entry `[library | null, class |
    null, {"type_hint": [library, class], ...}]` takes its type hint where the first two are null."""
    index = {}
    for name, spec in manifest.items():
        if (isinstance(spec, (list, tuple)) and len(spec) == 3 and spec[0] is None and isinstance(spec[2], dict)
                and isinstance(spec[2].get("type_hint"), (list, tuple)) and len(spec[2]["type_hint"]) == 2):
            spec = list(spec[2]["type_hint"])
        elif isinstance(spec, (list, tuple)) and len(spec) == 3 and isinstance(spec[2], dict):
            spec = list(spec[:2])
        index[name] = spec
    return index


def _read_json(path: str, folder: str) -> dict:
    where = os.path.relpath(path, folder)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: missing {where}") from None
    except (OSError, ValueError) as exc:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: cannot read {where} ({exc})") from None
    if not isinstance(data, dict):
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: {where} is not a JSON object")
    return data


def read_manifest(folder: str) -> dict:
    for name in MANIFESTS:
        if os.path.isfile(os.path.join(folder, name)):
            return _read_json(os.path.join(folder, name), folder)
    raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: it has neither {' nor '.join(MANIFESTS)}")


def check_pan2_checkpoint(folder) -> dict | None:
    """Raise NotPAN2CheckpointError unless `folder` is a local PAN2 checkpoint; returns its manifest in FastVideo's
    form (`component_index`). A hub id returns None: FastVideo downloads it, and the pipeline checks the download."""
    if is_hub_id(folder):
        return None
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise NotPAN2CheckpointError(f"model path {folder!r} is not a folder or a Hugging Face hub id (owner/name)")
    manifest = read_manifest(folder)
    class_name = manifest.get("_class_name")
    if not looks_like_pan2(str(class_name)):
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: its manifest's _class_name is {class_name!r} (expected one of "
            f"{', '.join(PIPELINE_CLASS_NAMES)})")
    missing = [name for name in REQUIRED_COMPONENTS if not os.path.isdir(os.path.join(folder, name))]
    if missing:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: missing component folder(s) {missing}")
    dit = _read_json(os.path.join(folder, "transformer", "config.json"), folder)
    if dit.get("_class_name") != TRANSFORMER_CLASS_NAME:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: transformer/config.json _class_name is "
                                     f"{dit.get('_class_name')!r} (expected {TRANSFORMER_CLASS_NAME!r})")
    try:
        config = PAN2TransformerConfig.from_json(dit)
    except (TypeError, ValueError) as exc:
        raise NotPAN2CheckpointError(f"{folder!r}: transformer/config.json is not a PAN2 transformer: {exc}") from None
    vae = _read_json(os.path.join(folder, "vae", "config.json"), folder)
    if not (vae.get("is_residual") is True and vae.get("patch_size") == 2):
        raise NotPAN2CheckpointError(
            f"{folder!r} is not a PAN2 checkpoint: vae/config.json is not a Wan2.2 VAE (needs is_residual: true, "
            f"patch_size: 2; got {vae.get('is_residual')!r}, {vae.get('patch_size')!r})")
    if vae.get("z_dim") != config.out_channels:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: the VAE's z_dim {vae.get('z_dim')!r} is "
                                     f"not the transformer's out_channels {config.out_channels}")
    text = _read_json(os.path.join(folder, "text_encoder", "config.json"), folder)
    if TEXT_ENCODER_CLASS_NAME not in (text.get("architectures") or []):
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: text_encoder/config.json architectures "
                                     f"{text.get('architectures')!r} (expected [{TEXT_ENCODER_CLASS_NAME!r}])")
    if text.get("hidden_size") != config.text_embed_dim:
        raise NotPAN2CheckpointError(f"{folder!r} is not a PAN2 checkpoint: the text encoder's hidden_size "
                                     f"{text.get('hidden_size')!r} is not the transformer's text_embed_dim "
                                     f"{config.text_embed_dim}")
    return component_index(manifest)


__all__ = ["NotPAN2CheckpointError", "PIPELINE_CLASS_NAME", "REQUIRED_COMPONENTS", "check_pan2_checkpoint",
           "component_index", "is_hub_id", "looks_like_pan2", "read_manifest"]
