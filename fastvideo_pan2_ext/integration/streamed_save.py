"""How a PAN2 video reaches its file (docs/design.md, "The streamed save"): whole or streamed, never partial.

FastVideo 0.2.1 saves in the parent process (in the generator's single-video step) after the worker has decoded the
whole video and handed it over as fp32 [B, 3, F, H, W] (481 frames at 704x1248: 5.1 GB, and once more as the
parent's `* 255` copy). For a PAN2 request that saves its video, that step is wrapped
(`adapter.wrap_generate_single_video`):

- Streamed (the fast decoder is on, the request saves without returning frames, pixel output, local `mp` workers
  sharing the filesystem): the parent puts a `StreamedSaveRequest` into the worker's `batch.extra[KEY]` and runs the
  request with FastVideo's save off. `PAN2DecodingStage` on rank 0 writes the mp4 through `video_io` as the decoder
  yields frames (byte-identical to FastVideo's save of the same frames, its batch grid layout included) and hands
  FastVideo `empty_output(...)` in place of the frames. The parent then fills `video_path` and `size` from the file, as
  FastVideo fills them.
- Otherwise FastVideo saves, into `video_io.partial_path(target)`.

Every PAN2 request with the fast decoder on, saved or not, also carries a `decode_failure.KeepLatentsRequest` (the
path FastVideo chose for its video, and the fps): a decode that fails keeps its latents beside it (`kept_latents`),
and the `DecodeFailed` FastVideo wraps in a RuntimeError is raised here as itself, so `VideoGenerator` raises it.

Either way the video is written beside its target under a partial name and renamed into place only when complete; a
failed or interrupted request removes the partial file. Every other request runs exactly as FastVideo runs it. A
streamed decode that runs out of memory after its first frames were written starts the file again at the decoder's
smaller plan (`WanVAEDecoder.decode_iter`'s `DecodeRestart`): the partial file is discarded and rewritten, so the
target only ever receives the whole video.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

import torch

from fastvideo_pan2_ext.configs.pan2 import PAN2PipelineConfig, check_frame_count, check_videos_per_request
from fastvideo_pan2_ext.vae_kernel.decoder import DecodeRestart
from fastvideo_pan2_ext.video_io import check_writable, mp4_size, partial_path, write_grid_stream

from . import adapter, decode_failure, fast_decode, memory_check, request_failure

logger = logging.getLogger(__name__)

KEY = "pan2_streamed_save"  # batch.extra key of the request


@dataclasses.dataclass(frozen=True)
class StreamedSaveRequest:
    """Parent -> decoding stage: write this request's video to `path` (atomically, via video_io) at `fps`."""

    path: str
    fps: float


def empty_output(batch_size: int, height: int, width: int) -> torch.Tensor:
    """What the decoding stage hands FastVideo after a streamed save: FastVideo requires a [B, 3, F, H, W] output
    tensor, and with its own save off and no frames returned it reads nothing of it but the geometry; the frames are
    in the file (F = 0)."""
    return torch.empty((batch_size, 3, 0, height, width))


@torch.no_grad()
def write_while_decoding(vae, latents: torch.Tensor, request: StreamedSaveRequest) -> None:
    """Decode with the fast decoder of `vae` and write the video to `request.path` as it comes (a batch side by side,
    as FastVideo saves one). Every rank of the decode group decodes its rows; rank 0 writes. A `DecodeRestart`
    (out of memory after frames were written: raised on every rank alike) discards the partial file and starts
    again, the decoder now at its smaller plan."""
    decoder = fast_decode.decoder_for(vae, latents.device)
    start = time.perf_counter()
    while True:
        chunks = [fast_decode.iter_decode(vae, latents[b:b + 1]) for b in range(latents.shape[0])]
        try:
            if not decoder.is_root:
                for _ in itertools.zip_longest(*chunks):  # in step with rank 0's writer: one collective pass a step
                    pass
                return
            frames = write_grid_stream(chunks, request.path, request.fps)  # removes its partial file on an error
            break
        except DecodeRestart:
            logger.warning("PAN2 decode: %s restarts at the decoder's smaller plan", request.path)
        finally:
            for stream in chunks:  # in the same order on every rank: a stream closed midway tells the group
                stream.close()
    logger.info("PAN2 decode: wrote %d frames to %s while decoding (%.2f s)", frames, request.path,
                time.perf_counter() - start)


def streams(fastvideo_args, sampling_param) -> bool:
    """Whether this request's video is written by the decoding stage while it decodes."""
    return (decode_failure.keeps_latents(fastvideo_args) and bool(sampling_param.save_video)
            and not sampling_param.return_frames and not sampling_param.return_trajectory_decoded)


def _generate(original, generator, prompt, sampling_param, fastvideo_args, **kwargs):
    args = fastvideo_args if fastvideo_args is not None else generator.fastvideo_args
    if not isinstance(args.pipeline_config, PAN2PipelineConfig) or sampling_param is None:
        return original(generator, prompt, sampling_param, fastvideo_args, **kwargs)
    try:
        return _generate_pan2(original, generator, prompt, sampling_param, fastvideo_args, args, **kwargs)
    except RuntimeError as exc:  # FastVideo re-raises its forward thread's error as a RuntimeError from it
        failed = decode_failure.failure_in(exc)
        if failed is None or failed is exc:
            raise
        raise decode_failure.DecodeFailed(failed.failure) from None  # the one line, not FastVideo's wrapper


def _generate_pan2(original, generator, prompt, sampling_param, fastvideo_args, args, **kwargs):
    check_videos_per_request(sampling_param.num_videos_per_prompt)
    check_frame_count(sampling_param.num_frames)
    args.pipeline_config.check_vae_options()
    memory_check.check_sampling(args, sampling_param)  # before the request reaches the workers
    if request_failure.fails_alone():
        kwargs = adapter.with_batch_extra(kwargs, request_failure.FAILS_ALONE_KEY, True)
    if decode_failure.keeps_latents(args):  # beside the path FastVideo chose, even for a request that saves nothing
        kwargs = adapter.with_batch_extra(kwargs, decode_failure.REQUEST_KEY, decode_failure.KeepLatentsRequest.beside(
            kwargs["output_path"], sampling_param.fps))
    if not sampling_param.save_video or args.output_type == "latent":
        return original(generator, prompt, sampling_param, fastvideo_args, **kwargs)
    target = Path(kwargs["output_path"])
    check_writable(target)
    partial = partial_path(target)
    _in_flight.add(partial)
    try:
        if streams(args, sampling_param):
            sampling_param = copy.copy(sampling_param)
            sampling_param.save_video = False  # the decoding stage saves
            kwargs = adapter.with_batch_extra(kwargs, KEY, StreamedSaveRequest(str(target), sampling_param.fps))
            logger.info("PAN2: the video is saved to %s by the decoding stage while it decodes (FastVideo's own save "
                        "is off for this request, hence 'save_video: False' below)", target)
            result = original(generator, prompt, sampling_param, fastvideo_args, **kwargs)
            result["video_path"] = str(target)
            result["size"] = mp4_size(target)
            logger.info("Saved video to %s (written by the decoding stage while it decoded)", target)
        else:
            result = original(generator, prompt, sampling_param, fastvideo_args,
                              **{**kwargs, "output_path": str(partial)})
            os.replace(partial, target)
            result["video_path"] = str(target)
    finally:
        partial.unlink(missing_ok=True)  # only there if the request failed or was interrupted
    _in_flight.discard(partial)  # done: a failed request's stays listed until its workers are stopped
    return result


_in_flight: set[Path] = set()  # partial files of this process's requests that have not completed


def remove_left_partials() -> None:
    """Remove the partial files of requests that did not complete (once their workers are stopped, nothing writes
    them any more)."""
    for partial in list(_in_flight):
        partial.unlink(missing_ok=True)
        _in_flight.discard(partial)


def install() -> None:
    adapter.wrap_generate_single_video(_generate)
