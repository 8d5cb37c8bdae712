"""Latents to video, in one command (docs/design/outputs.md, "Kept latents and the decode command"):

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

Every check (the file, the VAE against the latents, the options, the outputs) runs before any decoding; a failure
is one line `python -m fastvideo_pan2_ext.decode: error: ...` and exit code 2, and nothing is created: an existing
video is replaced only with `--overwrite` (`-y`), a link never (nor written through), a missing output folder is
an error. Each sample of the batch is decoded by `WanVAEDecoder.decode_iter` and streamed to its own mp4 (`video_io`:
the whole video is never in memory; written in a private folder of a random name beside it, renamed when complete),
with the decoder's progress bar. SIGINT and SIGTERM, at any moment, end the command with one line and 130 / 143,
leaving no partial file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from fastvideo_pan2_ext.names import DECODE_COMMAND as PROG

STOPPED = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated")}  # exit code, word


def _leave_at_once(signum, frame):
    """A signal before `main` runs (torch and diffusers take seconds to import): nothing is written yet."""
    code, word = STOPPED[signum]
    os.write(2, f"{PROG}: error: {word}; no video written\n".encode())
    os._exit(code)


if __name__ == "__main__":  # before the imports below
    for _signum in STOPPED:
        signal.signal(_signum, _leave_at_once)

import torch  # noqa: E402

from fastvideo_pan2_ext.media import latents_file
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import infer_config
from fastvideo_pan2_ext.vae_kernel.errors import first_line
from fastvideo_pan2_ext.vae_kernel import options as decoder_options
from fastvideo_pan2_ext.media.video_io import check_writable, write_video_stream

DEFAULT_FPS = {"wan2.2": 24.0, "wan2.1": 16.0}  # per latents layout: the fps Wan2.2's and Wan2.1's videos are made at
ORIGINAL_WAN_VAE_KEY = "decoder.middle.0.residual.0.gamma"  # what diffusers' single-file loader recognises a Wan VAE by


class DecodeCommandError(ValueError):
    """A problem the command reports in one line, before decoding."""


# ------------------------------------------------------------------------------------------------------- latents


def _bare_tensor(path: Path, is_safetensors: bool) -> torch.Tensor:
    """The one latents tensor of a safetensors or `torch.save` file (chosen by the file's content, not its name),
    its declared shape and dtype checked before any of its values is read (`latents_file.check_declared`): from a
    safetensors header, or a `torch.save` file mapped, not read."""
    from safetensors import safe_open

    try:
        if is_safetensors:
            with safe_open(str(path), framework="pt") as f:  # the header alone
                tensors = dict.fromkeys(f.keys())
        else:
            tensors = _torch_load(path)
            tensors = tensors if isinstance(tensors, dict) else {"": tensors}
    except Exception:  # safetensors, pickle, zip and torch each raise their own types for a file that is not theirs
        raise DecodeCommandError(f"{path}: not a latents file: neither safetensors nor torch.save holding a tensor "
                                 "(is it the right file?)") from None
    if len(tensors) == 1:
        (name,) = tensors
    elif "latents" in tensors:
        name = "latents"
    else:
        raise DecodeCommandError(f"{path}: holds {len(tensors)} entries ({', '.join(map(str, list(tensors)[:4]))}); "
                                 "expected one latents tensor")
    if is_safetensors:
        with safe_open(str(path), framework="pt") as f:
            return latents_file.declared_tensor(f, name, path)
    tensor = tensors[name]
    if not isinstance(tensor, torch.Tensor):
        raise DecodeCommandError(f"{path}: holds a {type(tensor).__name__}, not a latents tensor")
    latents_file.check_declared(path, tensor.shape, tensor.dtype)
    return tensor


def _torch_load(path: Path):
    """A `torch.save` file's content (weights only: no code runs), its tensors mapped from the file, not read (a
    file of the old, non-zip format has no mapping: read)."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        return torch.load(str(path), map_location="cpu", weights_only=True)


def read_latents(path, denormalized: bool) -> latents_file.KeptLatents | torch.Tensor:
    """A kept-latents file's content, or a bare latents tensor (DecodeCommandError naming the problem)."""
    path = Path(path)
    if not path.is_file():
        raise DecodeCommandError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DecodeCommandError(f"{path}: the file is empty")
    is_safetensors = _looks_like_safetensors(path)
    if is_safetensors:
        metadata = latents_file.metadata_of(path)
        if latents_file.is_kept_latents(metadata):
            if denormalized:
                raise DecodeCommandError(f"{path}: a kept-latents file says itself whether its latents are "
                                         "normalized; drop --denormalized")
            return latents_file.read(path)
    return _bare_tensor(path, is_safetensors)


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
        raise DecodeCommandError(f"--vae {path}: not a VAE checkpoint ({first_line(exc)})") from None
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
                                 f"({first_line(exc)})") from None


@contextlib.contextmanager
def _quietly():
    """Without diffusers' and huggingface_hub's own log lines and warnings (a failed load logs several before it
    raises): what goes wrong is the command's one line."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        diffusers_logging.set_verbosity(level)


def load_vae(path, dtype: torch.dtype = torch.float32, revision: str | None = None):
    """diffusers' `AutoencoderKLWan` in `dtype` from a VAE folder, a model folder with vae/, one original-format file,
    or a hub id ("org/name", at `revision`)."""
    with _quietly():
        return _load_vae(str(path), Path(path), dtype, revision)


def _load_vae(source: str, path: Path, dtype: torch.dtype, revision: str | None):
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
            found = f"a {class_name}'s" if class_name else "not a diffusers model config (no _class_name)"
            raise DecodeCommandError(f"--vae {path}: {folder / 'config.json'} is {found}, not a Wan VAE's "
                                     "(_class_name AutoencoderKLWan): give the Wan VAE's folder or its model folder")
        if not any(folder.glob("diffusion_pytorch_model*")):
            raise DecodeCommandError(f"--vae {path}: {folder} has a config.json but no weights "
                                     "(diffusion_pytorch_model.safetensors): is the download complete?")
        from diffusers import AutoencoderKLWan

        try:
            return AutoencoderKLWan.from_pretrained(str(folder), local_files_only=True, torch_dtype=dtype)
        except (OSError, ValueError, RuntimeError) as exc:
            raise DecodeCommandError(f"--vae {path}: cannot load it: {first_line(exc)}") from None
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

EXIT_CODES = """exit codes: 0 the video(s) written; 1 the decode failed after every check passed (nothing written);
2 a bad input or option (one line naming it; nothing decoded, nothing written); 130 interrupted (Ctrl-C, SIGINT);
143 terminated (SIGTERM). An interrupted or failed run leaves no partial file."""


def _fps(text: str) -> float:
    try:
        fps = float(text)
    except ValueError:
        fps = math.nan
    if not (math.isfinite(fps) and fps > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of frames per second, such as 24; got {text!r}")
    return fps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Decode saved Wan latents into mp4 video with the fast decoder "
                                "(streamed: the whole video is never in memory).")
    p.add_argument("latents", metavar="LATENTS", help="a kept-latents file, or a tensor file (torch.save or "
                   "safetensors) of latents [B, z_dim, T, h, w] as a pipeline returns them for output_type='latent'")
    p.add_argument("--vae", metavar="PATH", help="a diffusers VAE folder, a model folder with vae/, a hub id of "
                   "one, or one original-format Wan VAE file (default: the kept-latents file's)")
    p.add_argument("-o", "--output", metavar="OUT.mp4", help="the video (default: the kept-latents file's, else "
                   "LATENTS with .mp4); its folder must exist. A batch of B latents writes one video per sample, "
                   "OUT_0.mp4 ... OUT_<B-1>.mp4, or the names of a pattern with {} (-o 'clip-{}.mp4')")
    p.add_argument("-y", "--overwrite", action="store_true", help="replace existing videos (without it an "
                   "existing output is refused)")
    p.add_argument("--fps", type=_fps, help="frames per second (default: the kept-latents file's, else the "
                   f"latents' model's: {', '.join(f'{k} {v:g}' for k, v in DEFAULT_FPS.items())})")
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


def outputs(output: Path, batch: int) -> list[Path]:
    """One video per sample: `output` itself for one sample, else OUT_0.mp4, ...; a name with {} is a pattern."""
    if "{}" in output.name:
        return [output.with_name(output.name.replace("{}", str(b))) for b in range(batch)]
    if batch == 1:
        return [output]
    return [output.with_name(f"{output.stem}_{b}{output.suffix}") for b in range(batch)]


def check_outputs(paths: list[Path], overwrite: bool) -> None:
    """DecodeCommandError unless every video can be written: an .mp4 name, an existing folder files can be created
    in (nothing is created here), no existing file unless `overwrite`."""
    for path in paths:
        if path.suffix.lower() != ".mp4":
            raise DecodeCommandError(f"-o {path}: the output must be an .mp4 file")
        folder = path.parent
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise DecodeCommandError(f"-o {path}: the folder {folder} {what} (create it first)")
        if path.is_symlink():  # even with -y: whoever put the link there, the video neither follows nor replaces it
            raise DecodeCommandError(f"-o {path}: a symbolic link; a video is never written through one (name the "
                                     f"file itself)")
        if path.is_dir():
            raise DecodeCommandError(f"-o {path}: a folder of that name is in the way")
        if path.exists() and not overwrite:
            raise DecodeCommandError(f"-o {path}: the file exists; pass --overwrite (-y) to replace it")
    check_writable(paths[0])


def prepare(args):
    """Everything before decoding: -> (decoder, de-normalized latents, output paths, fps). DecodeCommandError or
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
    paths = outputs(Path(args.output or (kept.output if kept and kept.output else
                                         _default_output(Path(args.latents)))), z.shape[0])
    check_outputs(paths, args.overwrite)
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
    fps = args.fps or (kept.fps if kept and kept.fps else DEFAULT_FPS[layout])
    if not bool(torch.isfinite(z).all()):
        raise DecodeCommandError(f"{args.latents}: the latents contain NaN or Inf")
    normalized = kept.normalized if kept else not args.denormalized
    z = denormalize(z, vae) if normalized else z.float()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    decoder = WanVAEDecoder(vae, device=device, local=True, **options)
    z = z.to(decoder.device)
    decoder.plan(z.shape, stream=True)  # a budget that cannot be met fails here, not mid-video
    return decoder, z, paths, fps


class _Stopped(BaseException):
    """SIGINT or SIGTERM, raised where the program is, so every writer on the way out removes its partial file."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    for handled in STOPPED:  # a second signal must not cut the clean-up short
        signal.signal(handled, signal.SIG_IGN)
    raise _Stopped(signum)


def main(argv=None) -> int:
    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python delivers signals
    previous = {signum: signal.signal(signum, _stop) for signum in STOPPED} if in_main_thread else {}
    try:
        return _run(argv)
    finally:  # a caller in this process gets its own handlers back; the program, done, just exits
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if handler is _leave_at_once else handler)


def _run(argv) -> int:
    written: list[Path] = []
    try:
        args = parser().parse_args(argv)
        try:
            decoder, z, paths, fps = prepare(args)
        except (ValueError, OSError) as exc:
            _fail(first_line(exc))
        for b, path in enumerate(paths):
            frames = write_video_stream(decoder.decode_iter(z[b:b + 1]), path, fps)
            written.append(path)
            print(f"wrote {frames} frames to {path}")
    except (_Stopped, KeyboardInterrupt) as exc:
        code, word = STOPPED[exc.signum if isinstance(exc, _Stopped) else signal.SIGINT]
        _fail(f"{word}; {_what_was_written(written)}", code)
    except Exception as exc:  # a decode that fails after the checks: one line, no partial file
        _fail(f"the decode failed ({first_line(exc, with_type=True)}); "
              f"{_what_was_written(written)}", 1)
    return 0


def _what_was_written(written: list[Path]) -> str:
    if not written:
        return "no video written"
    return f"only {', '.join(map(str, written))} written (complete)"


if __name__ == "__main__":
    sys.exit(main())
