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

Every file is written beside its target in a `PartialFile` (a private folder of a random name holding the file) and
renamed into place only when complete: a failed or interrupted write leaves nothing at the target (and removes the
partial file when it can; the process that made the `PartialFile` can remove it too, `discard()`). No name this module
writes can be predicted or planted, and no link is followed below the folder the caller gave (docs/design/outputs.md,
"The streamed save and atomic output").
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import secrets
import stat
import threading
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


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # exclusive: never a planted name


def _kind(name: str, dir_fd: int) -> int | None:
    """The file type of `name` in the folder `dir_fd` (a link is a link), or None when nothing is there."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None


def open_folder(folder, root=None, create: bool = True) -> int:
    """An open descriptor of `folder` (the caller closes it). The caller's own path is taken as given, links and all:
    `root` when given (a server's output_dir), else `folder` itself (a user's -o folder). Every folder below `root`
    is opened without following a link (made first where missing, when `create`): a link there, planted or not, is an
    OSError naming it. Each folder is opened relative to the one above, so a folder swapped later is never used."""
    folder = Path(os.path.abspath(folder))
    if root is None:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        return os.open(folder, _DIR)
    root = Path(os.path.abspath(root))
    if folder != root and root not in folder.parents:
        raise OSError(f"{folder} is not under {root}")
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, _DIR)
    try:
        here = root
        for part in folder.relative_to(root).parts:
            here = here / part
            if create and _kind(part, fd) is None:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:  # made meanwhile: judged below like any other
                    pass
            if _kind(part, fd) == stat.S_IFLNK:
                raise OSError(f"{here} is a symbolic link (below {root} only real folders are used)")
            try:
                inner = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a link put there since the look
                    raise OSError(f"{here} is a symbolic link (below {root} only real folders are used)") from None
                raise
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_target(folder_fd: int, target: Path, prefix: str = "") -> None:
    """OSError (`prefix` and why) unless `target` (in `folder_fd`) is free or a regular file (which a finished video
    replaces)."""
    kind = _kind(target.name, folder_fd)
    if kind == stat.S_IFLNK:
        raise OSError(f"{prefix}it is a symbolic link: a video is never written through one (remove it, or name the "
                      f"file itself)")
    if kind == stat.S_IFDIR:
        raise OSError(f"{prefix}a folder of that name is in the way")
    if kind not in (None, stat.S_IFREG):
        raise OSError(f"{prefix}it is not a regular file")


def _new_name(folder_fd: int, prefix: str, suffix: str, make) -> str:
    """`make(name)` for a fresh random name (from `secrets`: nobody can guess it, so nobody can plant it); `make`
    must fail with FileExistsError for a name in use."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            make(name)
            return name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free random name after 100 tries")


def check_writable(path, root=None) -> None:
    """OSError (one line) unless a video can be written at `path`: its folder is reached (below `root` without a
    link, see `open_folder`; created if missing), `path` is not a link or a folder, and a real file is created and
    removed there (mode bits are not enough: root ignores them, read-only mounts do not), under a random name."""
    path = Path(os.path.abspath(path))
    folder = path.parent
    blocking = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise OSError(f"cannot write the video to {folder}: {blocking} is a file, not a folder")
    try:
        fd = open_folder(folder, root)
        try:
            _check_target(fd, path)
            probe = _new_name(fd, f".{path.name}.probe-", "", lambda name: os.close(os.open(name, _NEW_FILE, 0o600,
                                                                                          dir_fd=fd)))
            os.unlink(probe, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as exc:  # ENOENT in an existing folder: a virtual file system such as /proc
        if exc.strerror is None:  # ours: the line says it all
            raise OSError(f"cannot write the video to {path}: {exc}") from None
        reason = "files cannot be created there" if exc.errno == errno.ENOENT and folder.is_dir() else exc.strerror
        raise OSError(f"cannot write the video to {folder}: {reason}") from None


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """A video this process moved into place: its path and the identity of the file it wrote there (a server serves
    only that file, `open_written`)."""

    path: str
    device: int
    inode: int


def _through(fd: int, name: str) -> str | None:
    """A path to `name` in the folder open as `fd` that goes through this process's descriptor (/proc/<pid>/fd/<n>:
    resolved by the kernel to that very folder, wherever it now is), for writers that take a path (imageio's ffmpeg,
    a child process, FastVideo's save); None without /proc."""
    proc = f"/proc/{os.getpid()}/fd/{fd}"
    return f"{proc}/{name}" if os.path.isdir(proc) else None


class PartialFile:
    """Where a video bound for `target` is written until it is complete:
    `<target's folder>/.<name>.<random>.partial.mp4/<name>`, a folder only this user can enter (made by mkdir, which
    never follows a link, mode 0700, its name from `secrets`) holding the file (created exclusively). Writers use
    `path`, which reaches the folder through this process's descriptor of it: a folder swapped in under that name
    later is never written into. `commit()` renames the file onto the target; `discard()` removes both. `root`: see
    `open_folder`. Thread-safe: a server that stops discards the partial files of its jobs while their threads may
    be committing or discarding them (each descriptor is closed once, never another's that took its number)."""

    def __init__(self, target, root=None) -> None:
        self.target = Path(os.path.abspath(target))
        self.name = self.target.name
        self._lock = threading.RLock()
        self._parent: int | None = None
        self._fd: int | None = None
        self.folder_id: tuple[int, int] | None = None  # set once the folder is known to be the one made here
        error = None
        try:
            self._make(root)
        except OSError as exc:  # raised below, out of this block: the one line is the whole error, no context
            error = OSError(f"cannot write the video to {self.target}: {exc.strerror or exc}")
        except BaseException:
            self.discard()
            raise
        if error is not None:
            self.discard()
            raise error
        self.path = _through(self._fd, self.name) or str(self.folder / self.name)

    def _make(self, root) -> None:
        self._parent = open_folder(self.target.parent, root)
        _check_target(self._parent, self.target)
        self.folder_name = _new_name(self._parent, f".{self.name}.", ".partial.mp4",
                                     lambda name: os.mkdir(name, 0o700, dir_fd=self._parent))
        self.folder = self.target.parent / self.folder_name
        self._fd = os.open(self.folder_name, _DIR | os.O_NOFOLLOW, dir_fd=self._parent)
        st = os.fstat(self._fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:  # swapped between mkdir and open
            raise OSError(f"{self.folder} is not the private folder just made for the video")
        self.folder_id = (st.st_dev, st.st_ino)
        os.close(os.open(self.name, _NEW_FILE, 0o666, dir_fd=self._fd))

    @classmethod
    def reopen(cls, path, folder_id: tuple[int, int]) -> PartialFile:
        """The partial file at `path` that another process made (its folder's identity: `folder_id`), to write here:
        its folder is opened without following a link and must be that very folder (OSError otherwise). Only its
        maker commits or discards it; `close()` when done."""
        self = cls.__new__(cls)
        self.target = Path(path)
        self.name, self.folder = self.target.name, self.target.parent
        self._lock = threading.RLock()
        self._parent = None
        self._fd = os.open(self.folder, _DIR | os.O_NOFOLLOW)
        st = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != tuple(folder_id):
            self.close()
            raise OSError(f"cannot write the video to {path}: its folder is not the one made for it")
        self.folder_id = tuple(folder_id)
        self.path = _through(self._fd, self.name) or str(path)
        return self

    def commit(self) -> WrittenFile:
        """Move the finished file onto the target; -> what was written where. A target that became a link meanwhile is
        refused (OSError; the link stays, the video goes): a link there is someone else's doing. In the instant
        between that look and the rename, rename(2) would replace such a link itself, never write through it."""
        with self._lock:
            try:
                if self._fd is None:  # discarded meanwhile (a server stopping)
                    raise OSError(f"cannot write the video to {self.target}: its partial file was removed")
                st = os.stat(self.name, dir_fd=self._fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(f"cannot write the video to {self.target}: the partial file is not a regular file")
                _check_target(self._parent, self.target, f"cannot write the video to {self.target}: ")
                os.rename(self.name, self.name, src_dir_fd=self._fd, dst_dir_fd=self._parent)
                return WrittenFile(str(self.target), st.st_dev, st.st_ino)
            finally:
                self.discard()

    def discard(self) -> bool:
        """Remove the partial file and its folder (the folder by name only while that name is still it). Idempotent;
        while a writer in another process still writes there (the folder is not empty again), the folder stays and
        a later call removes it. -> whether it is done (nothing of it left to remove, no descriptor held)."""
        with self._lock:
            if self._fd is not None and self._parent is not None and self.folder_id is not None:
                for name in os.listdir(self._fd):  # the file, and anything a writer left beside it
                    try:
                        os.unlink(name, dir_fd=self._fd)
                    except OSError:
                        pass
                try:
                    st = os.stat(self.folder_name, dir_fd=self._parent, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == self.folder_id:
                        os.rmdir(self.folder_name, dir_fd=self._parent)
                except OSError as exc:
                    if exc.errno == errno.ENOTEMPTY:
                        return False  # written again since the listing: kept open for the next call
            self.close()
            return True

    def close(self) -> None:
        with self._lock:
            fds, self._fd, self._parent = (self._fd, self._parent), None, None
            for fd in fds:
                if fd is not None:
                    os.close(fd)


def open_written(written: WrittenFile, root=None) -> int:
    """A read descriptor of the file `written` names, only if it is still that very file (a regular file, opened
    without following a link, below `root` without a link: `open_folder`); OSError otherwise."""
    path = Path(written.path)
    folder = open_folder(path.parent, root, create=False)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
    finally:
        os.close(folder)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (written.device, written.inode):
        os.close(fd)
        raise OSError(f"{path} is no longer the video written there")
    return fd


def remove_video(path, root=None, identity: tuple[int, int] | None = None) -> None:
    """Remove the regular file at `path` (reached below `root` without a link, never a link itself), only if it is
    the file `identity` ((device, inode), e.g. a `WrittenFile`'s) when given; quietly nothing when it is gone or is
    not that file."""
    path = Path(path)
    try:
        folder = open_folder(path.parent, root, create=False)
    except OSError:
        return
    try:
        st = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and identity in (None, (st.st_dev, st.st_ino)):
            os.unlink(path.name, dir_fd=folder)
    except FileNotFoundError:
        pass
    finally:
        os.close(folder)


class _Mp4:
    """One mp4 being written frame by frame (imageio's ffmpeg writer with mimsave's defaults), in a `PartialFile`
    until `close(complete=True)`: its own (made for `path`, committed or discarded here), or one given as `path`
    (written in place; its maker commits it)."""

    def __init__(self, path, fps: float) -> None:
        import imageio  # only needed when writing

        self.owned = not isinstance(path, PartialFile)
        self.partial = PartialFile(path) if self.owned else path
        self.path = self.partial.target
        try:
            self.writer = imageio.get_writer(self.partial.path, fps=fps, format="mp4")
        except BaseException:
            if self.owned:
                self.partial.discard()
            raise
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
            if self.owned:
                if complete:
                    self.partial.commit()
                else:
                    self.partial.discard()


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
