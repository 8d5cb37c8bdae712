"""Streaming mp4 output: write decoded frames as they come, never holding the whole video.

`write_video_stream(chunks, path, fps)` takes what `WanVAEDecoder.decode_iter(latents)` yields ((sample, first
frame, chunk [1, 3, t, H, W] in [-1, 1]) tuples) or bare [1, 3, t, H, W] tensors, and appends each frame to `path`
as soon as its chunk arrives. Frames are quantised exactly as FastVideo's save step does (the decode's
`x / 2 + 0.5` clamped to [0, 1], `* 255`, truncated to uint8, in fp32) and written through imageio's ffmpeg writer
with `imageio.mimsave(path, frames, fps=fps, format="mp4")`'s defaults, so the file is byte-identical to that
non-streamed save of the same frames. One file holds one video: a chunk of a second batch sample is an error here;
`write_videos_stream(chunks, paths, fps)` writes one file per sample (samples arrive one after another), and
`write_grid_stream(per_sample_chunks, path, fps)` writes a batch into one file laid out exactly as FastVideo's save
lays one out (the samples side by side, `torchvision.utils.make_grid(..., nrow=6)`), reading the samples in lockstep.

Every file is written beside its target under `partial_path(target)` and renamed into place only when complete: a
failed or interrupted write leaves nothing at the target (and removes the partial file when it can; whoever runs the
writer in another process can remove it too, by the same name).
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch


def _to_uint8(chunk: torch.Tensor) -> torch.Tensor:
    """[..., 3, t, H, W] in [-1, 1] -> uint8, as FastVideo quantises a decoded video (its decode stage's
    `x / 2 + 0.5` clamped, then its save step's `(x * 255).clamp(0, 255)`, in fp32)."""
    unit = (chunk.float() / 2 + 0.5).clamp(0, 1)
    return (unit * 255).clamp_(0, 255).to(torch.uint8)


def to_uint8_frames(chunk: torch.Tensor) -> np.ndarray:
    """[1, 3, t, H, W] in [-1, 1] -> [t, H, W, 3] uint8, as FastVideo quantises a decoded video."""
    return _to_uint8(chunk[0]).permute(1, 2, 3, 0).contiguous().numpy()


def grid_frames(chunks: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each sample's [1, 3, t, H, W] chunk of the same frames -> t [H', W', 3] uint8 frames, the samples side by
    side exactly as FastVideo's save step lays out a batch (`make_grid(..., nrow=6)`; one sample: its own frame)."""
    from torchvision.utils import make_grid  # FastVideo's own dependency; only needed here

    u8 = _to_uint8(torch.cat(list(chunks)))  # [B, 3, t, H, W]
    return [make_grid(u8[:, :, i], nrow=6).permute(1, 2, 0).contiguous().numpy() for i in range(u8.shape[2])]


def _items(chunks):
    """(sample, first frame, chunk) for decode_iter tuples and bare tensors (one sample, frames in order)."""
    next_frame = 0
    for item in chunks:
        if isinstance(item, torch.Tensor):
            item = (0, next_frame, item)
        if not (isinstance(item, tuple) and len(item) == 3):
            raise ValueError(f"chunks must be decode_iter's (sample, first frame, chunk) tuples or [1, 3, t, H, W] "
                             f"tensors; got {type(item).__name__}")
        sample, frame, chunk = item
        if chunk is None:  # a decode-group rank other than 0 gets no frames
            continue
        if not isinstance(chunk, torch.Tensor) or chunk.dim() != 5 or chunk.shape[1] != 3:
            shape = list(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__
            raise ValueError(f"a chunk must be [1, 3, t, H, W]; got {shape}")
        if chunk.shape[0] != 1:
            raise ValueError(f"a chunk must hold one sample ([1, 3, t, H, W]); got batch {chunk.shape[0]}: stream "
                             f"decode_iter's chunks, or write one video per sample")
        next_frame = frame + chunk.shape[2]
        yield sample, frame, chunk


def check_writable(path) -> None:
    """OSError (one line) unless a video can be written at `path`: its folder is created if missing, and a real file
    is created and removed there (mode bits are not enough: root ignores them, read-only mounts do not)."""
    folder = Path(path).parent
    blocking = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise OSError(f"cannot write the video to {folder}: {blocking} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".{Path(path).name}.probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:  # ENOENT in an existing folder: a virtual file system such as /proc
        reason = "files cannot be created there" if exc.errno == errno.ENOENT and folder.is_dir() else exc.strerror
        raise OSError(f"cannot write the video to {folder}: {reason or exc}") from None


def partial_path(path) -> Path:
    """Where a video bound for `path` is written until it is complete (beside it: the rename stays on one disk)."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial.mp4")


class _Mp4:
    """One mp4 being written frame by frame (imageio's ffmpeg writer with mimsave's defaults), under its partial
    name until `close(complete=True)`."""

    def __init__(self, path, fps: float) -> None:
        import imageio  # only needed when writing

        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.writer = imageio.get_writer(self.partial, fps=fps, format="mp4")
        self.frames = 0

    def append(self, frame: int, images) -> None:
        """Append `images` ([H, W, 3] uint8 each), which must start at video frame `frame`."""
        if frame != self.frames:
            raise ValueError(f"chunks must come in frame order: {self.path} has {self.frames} frames, the next chunk "
                             f"starts at frame {frame}")
        for image in images:
            self.writer.append_data(image)
            self.frames += 1

    def close(self, complete: bool) -> None:
        """Finish the file and move it into place, or (not complete, or its finishing failed: an interrupt or a full
        disk while ffmpeg writes the file's tail) remove it."""
        try:
            self.writer.close()
        except BaseException:
            complete = False
            raise
        finally:
            if complete:
                os.replace(self.partial, self.path)
            else:
                self.partial.unlink(missing_ok=True)


def _check_fps(fps) -> None:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise ValueError(f"fps must be a positive number; got {fps!r}")


def _write_one(path, fps: float, frames) -> int:
    """Write `frames` ((first frame, [H, W, 3] uint8 images) pairs, in order) to one mp4, opened at the first pair.
    Returns the number of frames written."""
    mp4 = None
    complete = False
    try:
        for frame, images in frames:
            if mp4 is None:
                mp4 = _Mp4(path, fps)
            mp4.append(frame, images)
        complete = True
    finally:
        if mp4 is not None:
            mp4.close(complete)
    if mp4 is None:
        raise ValueError("no chunks to write (on a decode group, only rank 0 receives frames)")
    return mp4.frames


def write_video_stream(chunks: Iterable, path, fps: float) -> int:
    """Write one video's chunks to `path` as they come; returns the number of frames written. A chunk of sample 1
    or later (batch > 1) raises ValueError: use `write_videos_stream` for one file per sample."""
    _check_fps(fps)

    def frames():
        for sample, frame, chunk in _items(chunks):
            if sample != 0:
                raise ValueError(f"write_video_stream writes one video, but the chunks hold sample {sample} "
                                 f"(batch > 1): use write_videos_stream(chunks, paths, fps) for one file per sample")
            yield frame, to_uint8_frames(chunk)

    return _write_one(path, fps, frames())


def write_videos_stream(chunks: Iterable, paths, fps: float) -> list[int]:
    """One file per batch sample: `paths[b]` gets sample b's frames as they come. Returns frames written per file."""
    _check_fps(fps)
    paths = list(paths)
    written: list[int] = []
    mp4 = None
    complete = False
    try:
        for sample, frame, chunk in _items(chunks):
            if sample >= len(paths):
                raise ValueError(f"the chunks hold sample {sample} but only {len(paths)} paths were given")
            if mp4 is None or sample != len(written) - 1:
                if sample != len(written):
                    raise ValueError(f"samples must come one after another; got sample {sample} after "
                                     f"{len(written)} finished or started")
                if mp4 is not None:
                    mp4.close(complete=True)
                mp4 = _Mp4(paths[sample], fps)
                written.append(0)
            mp4.append(frame, to_uint8_frames(chunk))
            written[-1] = mp4.frames
        complete = True
    finally:
        if mp4 is not None:
            mp4.close(complete)
    return written


def write_grid_stream(per_sample_chunks: Sequence[Iterable], path, fps: float) -> int:
    """A batch into one mp4, laid out as FastVideo saves a batch (`grid_frames`): `per_sample_chunks[b]` yields
    sample b's chunks (e.g. `decode_iter(latents[b:b + 1])`), read in lockstep, so each step's frames are written as
    soon as every sample has them. One sample gives the same file as `write_video_stream`. Returns frames written."""
    _check_fps(fps)
    if not isinstance(per_sample_chunks, Sequence) or isinstance(per_sample_chunks, (str, bytes)) \
            or len(per_sample_chunks) == 0:
        raise ValueError(f"per_sample_chunks must be a non-empty list with one chunk iterable per sample, such as "
                         f"[decoder.decode_iter(latents[b:b + 1]) for b in range(B)]; got "
                         f"{type(per_sample_chunks).__name__}")
    streams = [_items(chunks) for chunks in per_sample_chunks]

    def frames():
        for step in itertools.zip_longest(*streams):
            if any(item is None for item in step):
                done = [b for b, item in enumerate(step) if item is None]
                raise ValueError(f"samples {done} ran out of chunks before the others: every sample of a batch has "
                                 f"the same frames")
            if any(sample != 0 for sample, _, _ in step):
                raise ValueError("each entry of per_sample_chunks must hold one sample (decode_iter(latents[b:b + 1]))")
            starts = {frame for _, frame, _ in step}
            shapes = {tuple(chunk.shape) for _, _, chunk in step}
            if len(starts) != 1 or len(shapes) != 1:
                raise ValueError(f"the samples' chunks disagree: start frames {sorted(starts)}, shapes "
                                 f"{sorted(shapes)}; lockstep chunks must cover the same frames at the same size")
            yield starts.pop(), grid_frames([chunk for _, _, chunk in step])

    return _write_one(path, fps, frames())


def mp4_size(path) -> tuple[int, int, int]:
    """(height, width, frames) as stored in a video file (imageio's writer pads frames to multiples of 16 pixels;
    PAN2's sizes are multiples of 32, so for a PAN2 video this is the decoded size FastVideo reports)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        width, height = next(reader)["size"]
    finally:
        reader.close()
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(path))
    return height, width, frames
