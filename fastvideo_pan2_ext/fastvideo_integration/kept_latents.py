"""A failed decode keeps the latents (docs/design/outputs.md, "Kept latents and the decode command").

Every PAN2 request with the fast decoder on (`decode_failure.keeps_latents`) carries a `KeepLatentsRequest` from the
parent: the video it is for, and its fps. When its decode in the worker fails for any reason after denoising (an
exception from the decoder, a full disk at the streamed save, ...), `keep` writes the latents the VAE was given
beside that video (`latents_file.path_for(output)`: `<stem>.latents.safetensors`, atomically, with what the decode
command needs to make the same video in its metadata: the checkpoint as given (a path, or a hub id and the commit
loaded), the VAE's dtype, layout, fps and decoder options) on rank 0 and hands FastVideo a placeholder output with a
`DecodeFailure` in the batch's `extra`. In the parent, `check_output` (run on what the workers return, before
FastVideo reads it) raises `DecodeFailed`, whose message is the one line naming the file and the decode command;
`streamed_save` re-raises it from `VideoGenerator`, and `fastvideo generate` prints it and exits 1. An interrupt
(KeyboardInterrupt, SIGTERM's SystemExit) is no Exception: nothing is written.
"""

from __future__ import annotations

import logging
import os

import torch

from fastvideo_pan2_ext.media import latents_file
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config
from fastvideo_pan2_ext.vae_kernel.errors import first_line

from . import compat, fast_decode, streamed_save
from .decode_failure import FAILURE_KEY, DecodeFailed, DecodeFailure, KeepLatentsRequest

logger = logging.getLogger(__name__)


def _layout_and_scale(vae) -> tuple[str, int]:
    """The VAE's layout name and spatial scale, read from its weights (FastVideo's config as a fallback)."""
    try:
        config = infer_config(vae.state_dict())
        return latents_file.layout_of(config), config.spatial_scale
    except ValueError:  # not weights the fast decoder reads: FastVideo's own config says which layout it is
        residual = bool(getattr(vae.config, "is_residual", False))
        return ("wan2.2", 16) if residual else ("wan2.1", 8)


def _vae_source(fastvideo_args) -> tuple[str, str | None]:
    """Where the job's VAE came from, as the decode command finds it again: a local checkpoint's absolute path, or
    the hub id and the commit FastVideo loaded (its `revision`, a branch or tag resolved to the commit of the
    snapshot in the local Hugging Face cache, which FastVideo loaded from; the revision as given when the cache
    cannot say)."""
    source = str(fastvideo_args.model_path)
    if os.path.exists(source):
        return os.path.abspath(source), None
    from huggingface_hub import snapshot_download

    revision = getattr(fastvideo_args, "revision", None)
    repo_id = "/".join(source.split("/")[:2])  # FastVideo's "org/name/subfolder" form names a folder of org/name
    try:
        snapshot = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (OSError, ValueError):  # not in the default cache (FastVideo was given another place): keep the latents
        return source, revision
    return source, os.path.basename(snapshot)  # the cache's snapshots/<commit> folder


def _is_root() -> bool:
    group = compat.executor.request_group()
    return group is None or torch.distributed.get_rank(group) == 0


def keep(stage, batch, latents: torch.Tensor, request: KeepLatentsRequest, fastvideo_args, error: Exception):
    """In the worker, after the decode of `latents` (de-normalized, as the VAE was given them) raised `error`: keep
    the latents beside `request.output` (rank 0) and return the batch with a placeholder output and the failure for
    the parent."""
    vae = stage.vae
    output = request.output  # absolute (`KeepLatentsRequest.beside`): the line and the file work from any folder
    path = latents_file.path_for(output)
    failure = DecodeFailure(first_line(error, with_type=True), str(path))
    layout, scale = _layout_and_scale(vae)
    if _is_root():
        opts = fast_decode.options(vae.config) or decoder_options.DecoderOptions()
        try:
            source, revision = _vae_source(fastvideo_args)
            kept = latents_file.KeptLatents(
                latents=latents, normalized=False, vae=source, vae_revision=revision,
                vae_dtype=latents_file.dtype_name(next(vae.parameters()).dtype), layout=layout,
                fps=float(request.fps), output=output, decoder_options=decoder_options.as_kwargs(opts))
            latents_file.write(path, kept)
        except Exception as exc:  # e.g. the disk that filled up at the save
            failure = DecodeFailure(failure.error, None, first_line(exc, with_type=True))
        logger.debug("PAN2 decode failed", exc_info=error)  # the parent says the one line
    batch.output = streamed_save.empty_output(latents.shape[0], latents.shape[3] * scale, latents.shape[4] * scale)
    batch.extra[FAILURE_KEY] = failure
    return batch


def check_output(output_batch) -> None:
    """In the parent, on what the workers returned: raise DecodeFailed for a decode that failed."""
    failure = (getattr(output_batch, "extra", None) or {}).get(FAILURE_KEY)
    if failure is not None:
        raise DecodeFailed(failure)


def install() -> None:
    compat.executor.on_execute_forward(check_output)
