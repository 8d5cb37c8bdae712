"""The kept-latents file (docs/design.md, "Kept latents and the decode command"): latents that did not become a video
yet, with everything `python -m fastvideo_pan2_ext.decode FILE` needs to make it.

A safetensors file holding one tensor, `latents` [B, z_dim, T, h, w], and string metadata:

    format            "fastvideo_pan2_ext.latents"
    format_version    "1"
    normalized        "true": as a pipeline's denoiser leaves them (the decode applies `z * std + mean` with the
                      VAE's latents_mean / latents_std first); "false": already de-normalized (what the VAE's
                      decode takes)
    vae               where the VAE comes from: a checkpoint folder (with vae/), a diffusers VAE folder, or a
                      single original-format Wan VAE file
    layout            "wan2.2" or "wan2.1" (the VAE's layout; the decode command checks the VAE against it)
    fps               frames per second of the video
    decoder_options   JSON: the fast decoder's options (frames_per_pass, tile_rows, max_memory, backend,
                      conv_algorithm; any subset)
    output            the video path the latents were meant for
    frames            the video's frame count (4T - 3)

`write` is atomic (a temporary file beside the target, then `os.replace`: nothing partial on failure); `read`
validates everything and raises `LatentsFileError` (a ValueError) with one line naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WanVAEConfig, video_frames
from fastvideo_pan2_ext.vae_kernel import options as decoder_options

FORMAT = "fastvideo_pan2_ext.latents"
FORMAT_VERSION = "1"
TENSOR = "latents"
SUFFIX = ".latents.safetensors"
LAYOUTS = ("wan2.2", "wan2.1")
DECODE_COMMAND = "python -m fastvideo_pan2_ext.decode"
_FIELDS = ("format", "format_version", "normalized", "vae", "layout", "fps", "decoder_options", "output", "frames")


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

    @property
    def frames(self) -> int:
        return video_frames(self.latents.shape[2])


def decode_command(path) -> str:
    """The command that turns the kept-latents file `path` into its video."""
    import shlex

    return f"{DECODE_COMMAND} {shlex.quote(str(path))}"


def layout_of(config: WanVAEConfig) -> str:
    """The layout name of a Wan VAE architecture (`vae_kernel.architecture.infer_config`)."""
    return "wan2.2" if config.residual else "wan2.1"


def path_for(output) -> Path:
    """Where the latents of a video bound for `output` are kept: `<output stem>.latents.safetensors` beside it."""
    output = Path(output)
    return output.with_name(output.stem + SUFFIX)


def _check(kept: KeptLatents, where: str) -> None:
    def fail(message):
        raise LatentsFileError(f"{where}: {message}")

    z = kept.latents
    if not isinstance(z, torch.Tensor) or z.dim() != 5 or not z.is_floating_point() or min(z.shape) < 1:
        fail(f"latents must be a float tensor [B, z_dim, T, h, w]; got "
             f"{list(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__}")
    if not isinstance(kept.normalized, bool):
        fail(f"normalized must be a bool; got {kept.normalized!r}")
    if not isinstance(kept.vae, str) or not kept.vae:
        fail(f"vae must name the VAE's source (a path); got {kept.vae!r}")
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
    """Write `kept` to `path` atomically (its folder must exist); returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    _check(kept, str(path))
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "normalized": json.dumps(kept.normalized),
                "vae": kept.vae, "layout": kept.layout, "fps": repr(float(kept.fps)),
                "decoder_options": json.dumps(kept.decoder_options), "output": kept.output,
                "frames": str(kept.frames)}
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        save_file({TENSOR: kept.latents.detach().to("cpu").contiguous()}, str(partial), metadata=metadata)
        os.chmod(partial, 0o644)  # as the videos beside it (safetensors creates its file private)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def metadata_of(path) -> dict[str, str] | None:
    """A safetensors file's metadata (None when it has none); LatentsFileError when `path` is no safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata()
    except Exception as exc:  # safetensors raises its own error types for every malformed file
        raise LatentsFileError(f"{path}: not a safetensors file ({str(exc).splitlines()[0] if str(exc) else exc})") \
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
        latents = f.get_tensor(TENSOR)
    try:
        normalized = json.loads(metadata["normalized"])
        fps = float(metadata["fps"])
        options = json.loads(metadata["decoder_options"])
        frames = int(metadata["frames"])
    except ValueError as exc:
        raise LatentsFileError(f"{path}: unreadable metadata ({exc})") from None
    kept = KeptLatents(latents, normalized, metadata["vae"], metadata["layout"], fps, options, metadata["output"])
    _check(kept, str(path))
    if frames != kept.frames:
        raise LatentsFileError(f"{path}: metadata says {frames} frames; {latents.shape[2]} latent frames make "
                               f"{kept.frames}")
    return kept
