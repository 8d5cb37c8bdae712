"""Latents to video, in one command (docs/design.md, "Kept latents and the decode command"):

    python -m fastvideo_pan2_ext.decode LATENTS [--vae PATH] [-o OUT.mp4] [--fps N] [--frames-per-pass N|auto]
        [--tile-rows N | --max-memory BYTES] [--backend auto|cuda|torch] [--conv-algorithm auto|direct|winograd]
        [--device DEVICE] [--denormalized]

LATENTS is
- a kept-latents file (`latents_file`, e.g. what a failed FastVideo decode left beside its output): the VAE (path or
  hub id at its recorded revision) and its dtype, fps, decoder options and output path come from its metadata (an
  argument given here wins), so the video is the one the job would have made;
- or a tensor file (`torch.save` or a one-tensor safetensors file) of latents [B, z_dim, T, h, w] as a pipeline
  returns them for `output_type="latent"`: diffusers' Wan pipelines and FastVideo both hand back the denoiser's
  *normalized* latents, so they are de-normalized here exactly as diffusers' WanPipeline does (`z * std + mean` with
  the VAE's `latents_mean` / `latents_std`); `--denormalized` says they already are (what the VAE's decode takes).

PATH is a diffusers VAE folder, a model folder with a `vae/` subfolder, a Hugging Face hub id of a model with `vae/`
(through the local Hugging Face cache, or fetched), or a single original-format Wan VAE file (.safetensors / .pth),
loaded through diffusers' own `AutoencoderKLWan.from_single_file` conversion with a config made locally from the
architecture read from the weights (diffusers converts the Wan2.1 layout only).

Every check (the file, the VAE against the latents, the options, the output folder) runs before any decoding; a
failure is one line `python -m fastvideo_pan2_ext.decode: error: ...` and exit code 2. The video is decoded by
`WanVAEDecoder.decode_iter` and streamed to the mp4 (`video_io`: the whole video is never in memory; written under a
partial name, renamed when complete), with the decoder's progress bar. A batch of B > 1 is one mp4, the samples side by side, as
FastVideo saves a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from fastvideo_pan2_ext import latents_file
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.video_io import check_writable, write_grid_stream

PROG = latents_file.DECODE_COMMAND
DEFAULT_FPS = 16.0  # diffusers' Wan examples export at 16 fps
ORIGINAL_WAN_VAE_KEY = "decoder.middle.0.residual.0.gamma"  # what diffusers' single-file loader recognises a Wan VAE by


class DecodeCommandError(ValueError):
    """A problem the command reports in one line, before decoding."""


# ------------------------------------------------------------------------------------------------------- latents


def _bare_tensor(path: Path, metadata) -> torch.Tensor:
    if metadata is not None or path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle, zip and torch each raise their own types for a file that is not theirs
            raise DecodeCommandError(f"{path}: not a tensor file (torch.save or safetensors): "
                                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        tensors = loaded if isinstance(loaded, dict) else {"": loaded}
    if len(tensors) == 1:
        (tensor,) = tensors.values()
    elif "latents" in tensors:
        tensor = tensors["latents"]
    else:
        raise DecodeCommandError(f"{path}: holds {len(tensors)} entries ({', '.join(map(str, list(tensors)[:4]))}); "
                                 "expected one latents tensor")
    if not isinstance(tensor, torch.Tensor):
        raise DecodeCommandError(f"{path}: holds a {type(tensor).__name__}, not a latents tensor")
    return tensor


def read_latents(path, denormalized: bool) -> latents_file.KeptLatents | torch.Tensor:
    """A kept-latents file's content, or a bare latents tensor (DecodeCommandError naming the problem)."""
    path = Path(path)
    if not path.is_file():
        raise DecodeCommandError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DecodeCommandError(f"{path}: the file is empty")
    metadata = None
    if _looks_like_safetensors(path):
        metadata = latents_file.metadata_of(path)
        if latents_file.is_kept_latents(metadata):
            if denormalized:
                raise DecodeCommandError(f"{path}: a kept-latents file says itself whether its latents are "
                                         "normalized; drop --denormalized")
            return latents_file.read(path)
        metadata = metadata or {}
    tensor = _bare_tensor(path, metadata)
    if tensor.dim() != 5 or not tensor.is_floating_point() or min(tensor.shape) < 1:
        raise DecodeCommandError(f"{path}: holds a {tensor.dtype} tensor of shape {list(tensor.shape)}; expected "
                                 "float latents [B, z_dim, T, h, w]")
    return tensor


def _looks_like_safetensors(path: Path) -> bool:
    """A safetensors file starts with an 8-byte little-endian header length, then a JSON header ('{')."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size


# ----------------------------------------------------------------------------------------------------------- VAE


def _single_file_vae(path: Path):
    """An original-format Wan VAE file through diffusers' own conversion (`from_single_file`), its config made here
    from the architecture its weights have (no network: diffusers would otherwise fetch a hub config)."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers, load_single_file_checkpoint

    try:
        checkpoint = load_single_file_checkpoint(str(path), local_files_only=True)
    except Exception as exc:  # safetensors / torch.load errors for a file that is not a checkpoint
        raise DecodeCommandError(f"--vae {path}: not a VAE checkpoint ({str(exc).splitlines()[0]})") from None
    if ORIGINAL_WAN_VAE_KEY not in checkpoint:
        raise DecodeCommandError(f"--vae {path}: not an original-format Wan VAE checkpoint (no {ORIGINAL_WAN_VAE_KEY!r}"
                                 "); give a diffusers VAE folder or a model folder with vae/")
    converted = convert_wan_vae_to_diffusers(dict(checkpoint))
    head = converted.get("decoder.conv_out.weight")
    if head is not None and head.shape[0] != 3:
        raise DecodeCommandError(f"--vae {path}: a Wan2.2-layout original checkpoint; diffusers' single-file "
                                 "conversion handles the Wan2.1 layout only: give the VAE's diffusers folder")
    try:
        arch = infer_config(converted)
        base_dim = converted["encoder.conv_in.weight"].shape[0]
    except (ValueError, KeyError) as exc:
        raise DecodeCommandError(f"--vae {path}: diffusers' conversion of it is not a Wan VAE: {exc}") from None
    config = {"_class_name": "AutoencoderKLWan", "base_dim": int(base_dim), "z_dim": arch.z_dim,
              "dim_mult": list(arch.dim_mult), "num_res_blocks": arch.num_res_blocks,
              "temperal_downsample": list(reversed(arch.temperal_upsample)), "is_residual": False}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        return AutoencoderKLWan.from_single_file(checkpoint, config=folder, local_files_only=True,
                                                 torch_dtype=torch.float32)


def _hub_vae(hub_id: str, revision: str | None, dtype: torch.dtype):
    """diffusers' `AutoencoderKLWan` of a hub checkpoint (its vae/, at `revision`), through the Hugging Face cache
    (fetched when the hub is reachable and not in it)."""
    from diffusers import AutoencoderKLWan

    parts = hub_id.split("/")  # "org/name", or FastVideo's "org/name/subfolder" form
    try:
        return AutoencoderKLWan.from_pretrained("/".join(parts[:2]), subfolder="/".join([*parts[2:], "vae"]),
                                                revision=revision, torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        at = f" at revision {revision}" if revision else ""
        raise DecodeCommandError(f"--vae {hub_id}: no such file or folder, and no hub checkpoint with a Wan VAE{at} "
                                 f"({str(exc).splitlines()[0]})") from None


def load_vae(path, dtype: torch.dtype = torch.float32, revision: str | None = None):
    """diffusers' `AutoencoderKLWan` in `dtype` from a VAE folder, a model folder with vae/, one original-format file,
    or a hub id ("org/name", at `revision`)."""
    source, path = str(path), Path(path)
    if path.is_dir():
        folder = next((p for p in (path, path / "vae") if (p / "config.json").is_file()), None)
        if folder is None:
            raise DecodeCommandError(f"--vae {path}: neither a diffusers VAE folder (config.json) nor a model folder "
                                     "with vae/config.json")
        try:
            class_name = json.loads((folder / "config.json").read_text()).get("_class_name")
        except (OSError, ValueError) as exc:
            raise DecodeCommandError(f"--vae {path}: unreadable {folder / 'config.json'} ({exc})") from None
        if class_name != "AutoencoderKLWan":
            raise DecodeCommandError(f"--vae {path}: {folder / 'config.json'} is a {class_name!r}, not a Wan VAE "
                                     "(AutoencoderKLWan)")
        from diffusers import AutoencoderKLWan

        try:
            return AutoencoderKLWan.from_pretrained(str(folder), local_files_only=True, torch_dtype=dtype)
        except (OSError, ValueError, RuntimeError) as exc:
            raise DecodeCommandError(f"--vae {path}: cannot load it: {str(exc).splitlines()[0]}") from None
    if path.is_file():
        return _single_file_vae(path).to(dtype)
    if _is_hub_id(source):
        return _hub_vae(source, revision, dtype)
    raise DecodeCommandError(f"--vae {path}: no such file or folder")


def _is_hub_id(source: str) -> bool:
    """A name the hub could hold ("org/name", optionally "/subfolder"): relative, and a valid repo id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    parts = source.split("/")
    if len(parts) < 2 or os.path.isabs(source) or source.startswith("."):
        return False
    try:
        validate_repo_id("/".join(parts[:2]))
    except HFValidationError:
        return False
    return True


def denormalize(z: torch.Tensor, vae) -> torch.Tensor:
    """`z * std + mean` with the VAE's latents_mean / latents_std, as diffusers' WanPipeline de-normalizes (fp32)."""
    mean, std = vae.config.latents_mean, vae.config.latents_std
    if mean is None or std is None or len(mean) != z.shape[1] or len(std) != z.shape[1]:
        raise DecodeCommandError(f"the VAE's latents_mean / latents_std do not have {z.shape[1]} entries (one per "
                                 "latent channel), so normalized latents cannot be de-normalized with it; pass "
                                 "--denormalized if they already are, or a VAE folder whose config has them")
    z = z.float()
    latents_mean = torch.tensor(mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    latents_std = 1.0 / torch.tensor(std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    return z / latents_std + latents_mean


# -------------------------------------------------------------------------------------------------------- command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Decode saved Wan latents into an mp4 with the fast decoder "
                                "(streamed: the whole video is never in memory).")
    p.add_argument("latents", metavar="LATENTS", help="a kept-latents file, or a tensor file (torch.save or "
                   "safetensors) of latents [B, z_dim, T, h, w] as a pipeline returns them for output_type='latent'")
    p.add_argument("--vae", metavar="PATH", help="a diffusers VAE folder, a model folder with vae/, a hub id of "
                   "one, or one original-format Wan VAE file (default: the kept-latents file's)")
    p.add_argument("-o", "--output", metavar="OUT.mp4", help="the video (default: the kept-latents file's, else "
                   "LATENTS with .mp4)")
    p.add_argument("--fps", type=float, help=f"frames per second (default: the kept-latents file's, else {DEFAULT_FPS:g})")
    p.add_argument("--denormalized", action="store_true", help="the tensor's latents are already de-normalized "
                   "(z * std + mean done); without it they are de-normalized with the VAE's latents_mean/std")
    decoder_options.add_arguments(p, unset=argparse.SUPPRESS)  # not given: the kept-latents file's, else defaults
    p.add_argument("--device", help="where to decode (default: cuda when available, else cpu)")
    p.error = lambda message: _fail(message)  # one line, no usage block
    return p


def _fail(message: str, code: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _default_output(latents_path: Path) -> Path:
    name = latents_path.name
    stem = name[:-len(latents_file.SUFFIX)] if name.endswith(latents_file.SUFFIX) else latents_path.stem
    return latents_path.with_name(stem + ".mp4")


def prepare(args):
    """Everything before decoding: -> (decoder, de-normalized latents, output path, fps). DecodeCommandError or
    ValueError / OSError naming the problem."""
    loaded = read_latents(args.latents, args.denormalized)
    kept = loaded if isinstance(loaded, latents_file.KeptLatents) else None
    z = kept.latents if kept else loaded
    vae_path = args.vae or (kept.vae if kept else None)
    vae_revision = kept.vae_revision if kept and not args.vae else None  # the file's revision is its VAE's
    vae_dtype = kept.torch_vae_dtype if kept else torch.float32  # the job's: its weights make the video
    if vae_path is None:
        raise DecodeCommandError("--vae PATH is needed for a bare latents tensor (only a kept-latents file names its "
                                 "VAE)")
    output = Path(args.output or (kept.output if kept and kept.output else _default_output(Path(args.latents))))
    if output.suffix.lower() != ".mp4":
        raise DecodeCommandError(f"-o {output}: the output must be an .mp4 file")
    check_writable(output)
    fps = args.fps if args.fps is not None else (kept.fps if kept else DEFAULT_FPS)
    if not fps > 0:
        raise DecodeCommandError(f"--fps must be a positive number; got {fps!r}")
    options = dict(kept.decoder_options) if kept else {}
    given = {name: getattr(args, name) for name in decoder_options.NAMES if hasattr(args, name)}
    if "tile_rows" in given or "max_memory" in given:  # one given here replaces the file's choice of both
        options.pop("tile_rows", None), options.pop("max_memory", None)
    options.update(given)

    vae = load_vae(vae_path, vae_dtype, vae_revision)
    if vae.config.z_dim != z.shape[1]:
        raise DecodeCommandError(f"--vae {vae_path}: a VAE of {vae.config.z_dim} latent channels cannot decode "
                                 f"latents of {z.shape[1]} (shape {list(z.shape)})")
    layout = latents_file.layout_of(infer_config(vae.state_dict()))
    if kept and kept.layout != layout:
        raise DecodeCommandError(f"--vae {vae_path}: a {layout} VAE; the latents were made for a {kept.layout} VAE")
    if not bool(torch.isfinite(z).all()):
        raise DecodeCommandError(f"{args.latents}: the latents contain NaN or Inf")
    normalized = kept.normalized if kept else not args.denormalized
    z = denormalize(z, vae) if normalized else z.float()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    decoder = WanVAEDecoder(vae, device=device, local=True, **options)
    z = z.to(decoder.device)
    decoder.plan(z.shape, stream=True)  # a budget that cannot be met fails here, not mid-video
    return decoder, z, output, fps


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        decoder, z, output, fps = prepare(args)
    except (ValueError, OSError) as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    try:  # the decoder shows its own progress bar (passes)
        written = write_grid_stream([decoder.decode_iter(z[b:b + 1]) for b in range(z.shape[0])], output, fps)
    except KeyboardInterrupt:
        _fail("interrupted; no video written", 130)
    except Exception as exc:  # a decode that fails after the checks: one line, nothing written
        _fail(f"the decode failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
              "no video written", 1)
    print(f"wrote {written} frames to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
