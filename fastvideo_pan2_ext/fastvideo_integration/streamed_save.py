"""How a PAN2 video reaches its file (docs/design/outputs.md, "The streamed save and atomic output"): whole or streamed,
never partial.

FastVideo 0.2.1 saves in the parent process (in the generator's single-video step) after the worker has decoded the
whole video and handed it over as fp32 [B, 3, F, H, W] (481 frames at 704x1248: 5.1 GB, and once more as the
parent's `* 255` copy). For a PAN2 request that saves its video, that step is wrapped
(`compat.executor.wrap_generate_single_video`):

- Streamed (the fast decoder is on, the request saves without returning frames, pixel output, local `mp` workers
  sharing the filesystem): the parent puts a `StreamedSaveRequest` into the worker's `batch.extra[KEY]` and runs the
  request with FastVideo's save off. `PAN2DecodingStage` on rank 0 writes the mp4 through `video_io` as the decoder
  yields frames (byte-identical to FastVideo's save of the same frames, its batch grid layout included) and hands
  FastVideo `empty_output(...)` in place of the frames. The parent then fills `video_path` and `size` from the file, as
  FastVideo fills them.
- Otherwise FastVideo saves, into the `video_io.PartialFile` made for the target.

Every PAN2 request with the fast decoder on, saved or not, also carries a `decode_failure.KeepLatentsRequest` (the
path FastVideo chose for its video, and the fps): a decode that fails keeps its latents beside it (`kept_latents`),
and the `DecodeFailed` FastVideo wraps in a RuntimeError is raised here as itself, so `VideoGenerator` raises it.

Either way the parent makes the `PartialFile` beside the target (a private folder of a random name; below the
server's output_dir, set by `confine_outputs`, no link is followed), the video is written into it and the parent
renames it into place only when complete, recording what it wrote where its caller asks (`recording`: the file a
server serves); a failed or interrupted request removes the partial file. Every other request runs exactly as FastVideo
runs it. A streamed decode that runs out of memory after its first frames were written starts the file again at the
decoder's smaller plan (`WanVAEDecoder.decode_iter`'s `DecodeRestart`): the partial file is discarded and rewritten,
so the target only ever receives the whole video.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import itertools
import logging
import time
from pathlib import Path

import torch

from fastvideo_pan2_ext.configs.pan2 import PAN2PipelineConfig, check_frame_count, check_videos_per_request
from fastvideo_pan2_ext.vae_kernel.decoder import DecodeRestart
from fastvideo_pan2_ext.media.video_io import PartialFile, mp4_size, write_grid_stream

from . import cancel, compat, decode_failure, fast_decode, memory_check, request_failure

logger = logging.getLogger(__name__)

KEY = "pan2_streamed_save"  # batch.extra key of the request


@dataclasses.dataclass(frozen=True)
class StreamedSaveRequest:
    """Parent -> decoding stage: write this request's video at `fps` into the partial file `path` the parent made
    (its folder's identity: `folder_id`, checked before writing; the parent moves it into place); without `folder_id`,
    `path` is the target, written atomically by the stage itself (one process: a test, a caller of the stage)."""

    path: str
    fps: float
    folder_id: tuple[int, int] | None = None


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
    reopened = decoder.is_root and request.folder_id is not None
    partial = PartialFile.reopen(request.path, request.folder_id) if reopened else None
    video = Path(request.path)
    if request.folder_id is not None:  # the parent's partial file: <folder>/<private folder>/<name>
        video = video.parent.parent / video.name
    try:
        while True:
            chunks = [fast_decode.iter_decode(vae, latents[b:b + 1]) for b in range(latents.shape[0])]
            try:
                if not decoder.is_root:
                    for _ in itertools.zip_longest(*chunks):  # in step with rank 0's writer: one collective pass a step
                        pass
                    return
                frames = write_grid_stream(chunks, partial or request.path, request.fps)  # a restart: the file anew
                break
            except DecodeRestart:
                logger.warning("PAN2 decode: %s restarts at the decoder's smaller plan", video)
            finally:
                for stream in chunks:  # in the same order on every rank: a stream closed midway tells the group
                    stream.close()
    finally:
        if partial is not None:
            partial.close()
    logger.info("PAN2 decode: wrote %d frames to %s while decoding (%.2f s)", frames, video,
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
        kwargs = compat.executor.with_batch_extra(kwargs, request_failure.FAILS_ALONE_KEY, True)
    if cancel.current() is not None:
        kwargs = compat.executor.with_batch_extra(kwargs, cancel.KEY, cancel.current())
    if decode_failure.keeps_latents(args):  # beside the path FastVideo chose, even for a request that saves nothing
        kwargs = compat.executor.with_batch_extra(
            kwargs, decode_failure.REQUEST_KEY,
            decode_failure.KeepLatentsRequest.beside(kwargs["output_path"], sampling_param.fps))
    if not sampling_param.save_video or args.output_type == "latent":
        return original(generator, prompt, sampling_param, fastvideo_args, **kwargs)
    target = Path(kwargs["output_path"])
    partial = PartialFile(target, root=_root)  # one line (OSError) for a target or folder that is a link
    _in_flight.add(partial)
    try:
        if streams(args, sampling_param):
            sampling_param = copy.copy(sampling_param)
            sampling_param.save_video = False  # the decoding stage saves
            kwargs = compat.executor.with_batch_extra(kwargs, KEY, StreamedSaveRequest(
                str(partial.folder / partial.name), sampling_param.fps, partial.folder_id))
            logger.info("PAN2: the video is saved to %s by the decoding stage while it decodes (FastVideo's own save "
                        "is off for this request, hence 'save_video: False' below)", target)
            result = original(generator, prompt, sampling_param, fastvideo_args, **kwargs)
            result["size"] = mp4_size(partial.path)  # the file written, read before it is moved
        else:
            result = original(generator, prompt, sampling_param, fastvideo_args,
                              **{**kwargs, "output_path": partial.path})
        written = partial.commit()
        if _written_to.get() is not None:
            _written_to.get().append(written)
        result["video_path"] = str(target)
        logger.info("Saved video to %s", target)
    finally:
        # Only there if the request failed or was interrupted. Once removed it is released (a served job's when the
        # job ends); one a worker still writes into (an interrupted request) stays listed until the workers stop.
        if partial.discard():
            _in_flight.discard(partial)
    return result


_in_flight: set[PartialFile] = set()  # partial files of this process's requests not yet committed or removed
_root: Path | None = None  # `confine_outputs`
_written_to: contextvars.ContextVar[list | None] = contextvars.ContextVar("pan2_written_to", default=None)


@contextlib.contextmanager
def recording(written: list):
    """The video each request this thread makes inside the block moves into place is appended to `written` (its
    `video_io.WrittenFile`) as soon as it is there: a server knows what a job wrote even if it stops before the job
    ends."""
    token = _written_to.set(written)
    try:
        yield
    finally:
        _written_to.reset(token)


def confine_outputs(root) -> None:
    """This process's videos are written below `root` (a server's output_dir) without following a link there (a
    target or folder that is one is refused in one line); None: each target's folder as its caller gives it."""
    global _root
    _root = Path(root) if root is not None else None


def output_root() -> Path | None:
    return _root


def remove_left_partials() -> None:
    """Remove the partial files of requests that did not complete (once their workers are stopped, nothing writes
    them any more)."""
    for partial in list(_in_flight):
        partial.discard()
        _in_flight.discard(partial)


def install() -> None:
    compat.executor.wrap_generate_single_video(_generate)
