"""The kept-latents file (docs/design/outputs.md, "Kept latents and the decode command"): latents that did not become a
video yet, with everything `python -m fastvideo_pan2_ext.decode FILE` needs to make it.

A safetensors file holding one tensor, `latents` [B, z_dim, T, h, w], and string metadata:

    format            "fastvideo_pan2_ext.latents"
    format_version    "2"
    normalized        "true": as a pipeline's denoiser leaves them (the decode applies `z * std + mean` with the
                      VAE's latents_mean / latents_std first); "false": already de-normalized (what the VAE's
                      decode takes)
    vae               where the VAE comes from, as the job was given it: a checkpoint folder (with vae/), a diffusers
                      VAE folder or a single original-format Wan VAE file (an absolute path), or a Hugging Face hub
                      id ("org/name"; its VAE in vae/)
    vae_revision      the hub commit the job loaded (a hub id's; "" for a path)
    vae_dtype         the dtype of the VAE's weights in the job ("float32", "bfloat16" or "float16"): the fast
                      decoder prepares its weights from them, so the same video needs the same dtype
    layout            "wan2.2" or "wan2.1" (the VAE's layout; the decode command checks the VAE against it)
    fps               frames per second of the video
    decoder_options   JSON: the fast decoder's options (frames_per_pass, tile_rows, max_memory, backend,
                      conv_algorithm; any subset)
    output            the video path the latents were meant for
    frames            the video's frame count (4T - 3)

`write` publishes the file whole and durably: a temporary file beside the target, created as any new file of the
process is (its mode follows the umask), fsynced, renamed into place, then the folder fsynced (nothing partial on
failure, nothing lost to a crash after the line naming it). `read` validates everything and raises
`LatentsFileError` (a ValueError) with one line naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from pathlib import Path

import torch

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WanVAEConfig, video_frames
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.vae_kernel.distributed.agreement import supported_dtype
from fastvideo_pan2_ext.vae_kernel.errors import first_line
from fastvideo_pan2_ext.vae_kernel.planning.memory import format_bytes

FORMAT = "fastvideo_pan2_ext.latents"
FORMAT_VERSION = "2"
TENSOR = "latents"
SUFFIX = ".latents.safetensors"
LAYOUTS = ("wan2.2", "wan2.1")
VAE_DTYPES = ("float32", "bfloat16", "float16")
DECODE_MODULE = "fastvideo_pan2_ext.decode"
DECODE_COMMAND = f"python -m {DECODE_MODULE}"  # its name in messages
_FIELDS = ("format", "format_version", "normalized", "vae", "vae_revision", "vae_dtype", "layout", "fps",
           "decoder_options", "output", "frames")


class LatentsFileError(ValueError):
    """A kept-latents file that cannot be used (one line: the file and the problem)."""


@dataclasses.dataclass(frozen=True)
class KeptLatents:
    """A kept-latents file's content."""

    latents: torch.Tensor  # [B, z_dim, T, h, w]
    normalized: bool
    vae: str
    layout: str
    fps: float
    decoder_options: dict
    output: str
    vae_dtype: str = "float32"  # one of VAE_DTYPES
    vae_revision: str | None = None  # the hub commit of a hub id

    @property
    def frames(self) -> int:
        return video_frames(self.latents.shape[2])

    @property
    def torch_vae_dtype(self) -> torch.dtype:
        return getattr(torch, self.vae_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """`vae_dtype`'s spelling of a torch dtype ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


def decode_command(path) -> str:
    """The command that turns the kept-latents file `path` into its video, ready to paste into a shell: this
    process's interpreter (the one whose environment has this package) and the quoted path."""
    return shlex.join([sys.executable, "-m", DECODE_MODULE, str(path)])


def layout_of(config: WanVAEConfig) -> str:
    """The layout name of a Wan VAE architecture (`vae_kernel.definitions.architecture.infer_config`)."""
    return "wan2.2" if config.residual else "wan2.1"


def path_for(output) -> Path:
    """Where the latents of a video bound for `output` are kept: `<output stem>.latents.safetensors` beside it."""
    output = Path(output)
    return output.with_name(output.stem + SUFFIX)


LATENTS_DTYPES = "float32, bfloat16, float16 or float64"  # the decoder's (`agreement.supported_dtype`), in messages


def memory_left() -> int | None:
    """Bytes this process may still allocate, the least of what is known (None where nothing is): the host's
    available memory, its cgroup's room (v2 or v1) and its address-space limit (RLIMIT_AS) less what it maps."""
    import resource

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text()
        except OSError:
            return None

    room = []
    meminfo = read("/proc/meminfo") or ""
    room += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2, then v1
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit_text, usage_text = read(limit), read(usage)
        if limit_text and usage_text and limit_text.strip().isdigit():
            room.append(int(limit_text) - int(usage_text))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    status = read("/proc/self/status") or ""
    mapped = [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:")]
    if soft != resource.RLIM_INFINITY and mapped:
        room.append(soft - mapped[0])
    return max(0, min(room)) if room else None


def check_declared(where, shape, dtype) -> None:
    """LatentsFileError naming `where` unless a tensor of `shape` and `dtype`, as a file declares them before any of
    it is read, can be latents decoded here: [B, z_dim, T, h, w], every size >= 1, of a dtype the decoder takes, and
    small enough for this process to hold with the float32 copy the decode makes of them (`memory_left`)."""
    shape = list(shape)
    if len(shape) != 5 or min(shape) < 1 or not (isinstance(dtype, torch.dtype) and supported_dtype(dtype)):
        raise LatentsFileError(f"{where}: holds a {dtype} tensor of shape {shape}; expected float latents [B, z_dim, "
                               f"T, h, w] of {LATENTS_DTYPES}")
    needed, left = math.prod(shape) * (dtype.itemsize + 4), memory_left()
    if left is not None and needed > left:
        raise LatentsFileError(f"{where}: latents {shape} of {dtype} take {format_bytes(needed)} with their float32 "
                               f"copy; this process can allocate {format_bytes(left)} more")


def declared_tensor(f, name: str, where) -> torch.Tensor:
    """The tensor `name` of the open safetensors file `f` (`safe_open`), read only after its declared shape and dtype
    pass `check_declared` (from the header: a sparse file declaring terabytes is refused without reading it)."""
    from safetensors import torch as safetensors_torch

    declared = f.get_slice(name)
    dtype = getattr(safetensors_torch, "_TYPES", {}).get(declared.get_dtype(), declared.get_dtype())
    check_declared(where, declared.get_shape(), dtype)
    return f.get_tensor(name)


def _check(kept: KeptLatents, where: str) -> None:
    def fail(message):
        raise LatentsFileError(f"{where}: {message}")

    z = kept.latents
    if not isinstance(z, torch.Tensor) or z.dim() != 5 or not supported_dtype(z.dtype) or min(z.shape) < 1:
        fail(f"latents must be a float tensor [B, z_dim, T, h, w] of {LATENTS_DTYPES}; got "
             f"{f'{list(z.shape)} {z.dtype}' if isinstance(z, torch.Tensor) else type(z).__name__}")
    if not isinstance(kept.normalized, bool):
        fail(f"normalized must be a bool; got {kept.normalized!r}")
    if not isinstance(kept.vae, str) or not kept.vae:
        fail(f"vae must name the VAE's source (a path or a hub id); got {kept.vae!r}")
    if kept.vae_revision is not None and (not isinstance(kept.vae_revision, str) or not kept.vae_revision):
        fail(f"vae_revision must be a hub revision or None; got {kept.vae_revision!r}")
    if kept.vae_dtype not in VAE_DTYPES:
        fail(f"vae_dtype must be one of {', '.join(VAE_DTYPES)}; got {kept.vae_dtype!r}")
    if kept.layout not in LAYOUTS:
        fail(f"layout must be one of {', '.join(LAYOUTS)}; got {kept.layout!r}")
    if isinstance(kept.fps, bool) or not isinstance(kept.fps, (int, float)) or not (math.isfinite(kept.fps)
                                                                                    and kept.fps > 0):
        fail(f"fps must be a positive number; got {kept.fps!r}")
    if not isinstance(kept.output, str):
        fail(f"output must be a path; got {kept.output!r}")
    options = kept.decoder_options
    if not isinstance(options, dict):
        fail(f"decoder_options must be a dict of the decoder's options; got {options!r}")
    try:
        decoder_options.check(options)
    except ValueError as exc:
        fail(f"decoder_options: {exc}")


def write(path, kept: KeptLatents) -> Path:
    """Write `kept` to `path` atomically and durably (its folder must exist); returns the path."""
    from safetensors.torch import save

    path = Path(path)
    _check(kept, str(path))
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "normalized": json.dumps(kept.normalized),
                "vae": kept.vae, "vae_revision": kept.vae_revision or "", "vae_dtype": kept.vae_dtype,
                "layout": kept.layout, "fps": repr(float(kept.fps)),
                "decoder_options": json.dumps(kept.decoder_options), "output": kept.output,
                "frames": str(kept.frames)}
    data = save({TENSOR: kept.latents.detach().to("cpu").contiguous()}, metadata=metadata)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.unlink(missing_ok=True)  # a leftover of a killed writer of this pid: the new file gets a new mode
    try:
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:  # mode: 0666 & ~umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    _fsync_folder(path.parent)  # the rename itself on disk
    return path


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def metadata_of(path) -> dict[str, str] | None:
    """A safetensors file's metadata (None when it has none); LatentsFileError when `path` is no safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata()
    except Exception as exc:  # safetensors raises its own error types for every malformed file
        raise LatentsFileError(f"{path}: not a safetensors file ({first_line(exc)})") \
            from None


def is_kept_latents(metadata: dict[str, str] | None) -> bool:
    return bool(metadata) and metadata.get("format") == FORMAT


def read(path) -> KeptLatents:
    """Read and validate a kept-latents file (LatentsFileError, one line, naming the problem)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise LatentsFileError(f"{path}: no such file")
    metadata = metadata_of(path)
    if not is_kept_latents(metadata):
        raise LatentsFileError(f"{path}: not a kept-latents file (its metadata has no format {FORMAT!r})")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise LatentsFileError(f"{path}: format version {metadata.get('format_version')!r}; this package reads "
                               f"version {FORMAT_VERSION}")
    missing = [field for field in _FIELDS if field not in metadata]
    if missing:
        raise LatentsFileError(f"{path}: metadata lacks {', '.join(missing)}")
    with safe_open(str(path), framework="pt") as f:
        if list(f.keys()) != [TENSOR]:
            raise LatentsFileError(f"{path}: must hold exactly one tensor, {TENSOR!r}; holds {list(f.keys())}")
        latents = declared_tensor(f, TENSOR, path)
    try:
        normalized = json.loads(metadata["normalized"])
        fps = float(metadata["fps"])
        options = json.loads(metadata["decoder_options"])
        frames = int(metadata["frames"])
    except ValueError as exc:
        raise LatentsFileError(f"{path}: unreadable metadata ({exc})") from None
    kept = KeptLatents(latents, normalized, metadata["vae"], metadata["layout"], fps, options, metadata["output"],
                       metadata["vae_dtype"], metadata["vae_revision"] or None)
    _check(kept, str(path))
    if frames != kept.frames:
        raise LatentsFileError(f"{path}: metadata says {frames} frames; {latents.shape[2]} latent frames make "
                               f"{kept.frames}")
    return kept
