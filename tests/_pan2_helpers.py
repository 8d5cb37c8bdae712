"""Helpers for the PAN2 plugin tests: the tiny checkpoint, sample and sign-off images, subprocess runners.

Nothing here imports FastVideo or torch at module level.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
FASTVIDEO_CLI = str(VENV_BIN / "fastvideo")

# Nothing in these tests may reach the network (Hugging Face hub lookups included).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# The e2e request: a 3:2 first frame at 64x96 (area 6144 -> exactly 96 wide x 64 high), 9 frames = 4 x 3 - 3.
E2E_HEIGHT, E2E_WIDTH, E2E_FRAMES = 64, 96, 9


def tiny_checkpoint(base: Path) -> Path:
    """The tiny PAN2 checkpoint under `base` (made once per test session; later calls reuse it)."""
    out = base / "pan2-tiny"
    if not (out / "modular_model_index.json").exists():
        partial = base / f"pan2-tiny.partial-{os.getpid()}"
        proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(partial)], env_extra=OFFLINE)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == str(partial)
        partial.rename(out)  # a complete folder appears at once
    return out


WAN22 = ("Wan2.2-TI2V-5B-Diffusers", "wan2.2-ti2v")  # (the folder name FastVideo matches, the maker's layout)
WAN21 = ("Wan2.1-T2V-1.3B-Diffusers", "wan2.1-t2v")


def stock_checkpoint(base: Path, name: str, layout: str) -> Path:
    """The tiny stock checkpoint `base/stock/<name>` of `layout` (made once per test session; later calls reuse it)."""
    out = base / "stock" / name
    if not (out / "model_index.json").exists():
        partial = base / f"stock-{layout}.partial-{os.getpid()}"
        proc = run([sys.executable, "-m", "fastvideo_pan2_ext.demo.tiny_checkpoints", str(partial), "--layout",
                    layout], env_extra=OFFLINE)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.parent.mkdir(exist_ok=True)
        partial.rename(out)  # a complete folder appears at once, under the name FastVideo matches
    return out


def exif_rotated_jpeg(path: Path, width: int = 192, height: int = 128, orientation: int = 6) -> Path:
    """A landscape gradient JPEG whose EXIF says 'rotate 90 degrees to display' (stored pixels stay landscape)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x * 7 + y * 3) % 256], -1).astype(np.uint8)
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = orientation
    img.save(path, exif=exif.tobytes(), quality=95)
    return path


def make_signoff_images(folder: Path) -> list[Path]:
    """The first-frame sign-off set: awkward real files, each a different way for image reading to go wrong."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)

    def rgb(w, h):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + 2 * y) % 256], -1)
        noise = rng.integers(0, 40, size=(h, w, 3))
        return np.clip(base + noise, 0, 255).astype(np.uint8)

    made: list[Path] = []

    def save(name, img, **kwargs):
        path = folder / name
        img.save(path, **kwargs)
        made.append(path)

    made.append(exif_rotated_jpeg(folder / "exif_rotate90.jpg", 240, 160, orientation=6))
    png_exif = Image.fromarray(rgb(160, 120))
    exif = png_exif.getexif()
    exif[0x0112] = 8
    save("exif_rotate270.png", png_exif, exif=exif.tobytes())
    alpha = rng.integers(0, 256, size=(150, 200, 1)).astype(np.uint8)
    save("rgba.png", Image.fromarray(np.concatenate([rgb(200, 150), alpha], -1)))
    save("grayscale.png", Image.fromarray(rgb(130, 97)[..., 0]))
    save("grayscale_alpha.png", Image.fromarray(np.stack([rgb(120, 90)[..., 1], alpha[:90, :120, 0]], -1)))
    gray16 = (rgb(144, 96)[..., 0].astype(np.uint16) * 257 + rng.integers(0, 256, (96, 144))).astype(np.uint16)
    save("gray16.png", Image.fromarray(gray16))
    save("cmyk.jpg", Image.fromarray(rgb(180, 120)).convert("CMYK"), quality=92)
    save("palette.gif", Image.fromarray(rgb(170, 110)).convert("P", palette=Image.Palette.ADAPTIVE, colors=64))
    pal = Image.fromarray(rgb(100, 100)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    save("palette_transparent.png", pal, transparency=3)
    save("panorama_8to1.jpg", Image.fromarray(rgb(1024, 128)), quality=90)
    save("tall_1to6.png", Image.fromarray(rgb(96, 576)))
    save("tiny_7x5.bmp", Image.fromarray(rgb(7, 5)))
    save("bilevel.tif", Image.fromarray(rgb(64, 48)[..., 2] > 128))
    save("progressive_420.jpg", Image.fromarray(rgb(321, 203)), quality=85, progressive=True, subsampling=2)
    save("lossy.webp", Image.fromarray(rgb(150, 100)), quality=80)
    return made


def truncated_png(path: Path) -> Path:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buf, "PNG", compress_level=0)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def decompression_bomb_png(path: Path, width: int = 20000, height: int = 20000) -> Path:
    """A tiny PNG file whose header claims width x height pixels (a valid header, CRC included; no pixel data)."""
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = 8  # after the PNG signature: length(4) "IHDR"(4) data(13) crc(4)
    data[ihdr + 8:ihdr + 16] = struct.pack(">II", width, height)
    data[ihdr + 21:ihdr + 25] = struct.pack(">I", zlib.crc32(bytes(data[ihdr + 4:ihdr + 21])))
    path.write_bytes(bytes(data))
    return path


def fake_flash_attn(folder: Path) -> Path:
    """A stand-in `flash_attn` package with an importable `flash_attn.cute` (the FA4 policy only checks that it
    imports). Put `folder` on sys.path / PYTHONPATH."""
    pkg = folder / "flash_attn"
    (pkg / "cute").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("def flash_attn_func(*args, **kwargs):\n    raise RuntimeError('stand-in')\n")
    (pkg / "cute" / "__init__.py").write_text("def flash_attn_func(*args, **kwargs):\n"
                                              "    raise RuntimeError('stand-in')\n")
    # FastVideo's FA2 path also imports these names when its flash-attention module loads.
    (pkg / "flash_attn_interface.py").write_text("def flash_attn_func(*args, **kwargs):\n    raise RuntimeError\n"
                                                 "def _flash_attn_backward(*args, **kwargs):\n    raise RuntimeError\n")
    return folder


RECORDING_FA4 = textwrap.dedent("""
    import torch

    calls = []  # the q shape [B, S, H, D] of each call


    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, **kwargs):
        calls.append(list(q.shape))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        scale = q.shape[-1]**-0.5 if softmax_scale is None else softmax_scale
        lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) * scale, dim=-1)
        return out.transpose(1, 2).contiguous(), lse


    def _flash_attn_bwd(*args, **kwargs):
        raise NotImplementedError("the stand-in FA4 runs forward only")


    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kwargs):
        return _flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)[0]
""")


def recording_fa4(folder: Path) -> Path:
    """A stand-in FA4 installed as flash-attn-4 installs it (`flash_attn.cute` only, no FA2 beside it), whose kernel
    entry point (`flash_attn.cute.interface._flash_attn_fwd`, what FastVideo calls) records each call in `calls` and
    computes the attention with torch's SDPA. Put `folder` on sys.path."""
    cute = folder / "flash_attn" / "cute"
    cute.mkdir(parents=True, exist_ok=True)
    (cute / "interface.py").write_text(RECORDING_FA4)
    (cute / "__init__.py").write_text("from .interface import flash_attn_func  # noqa: F401\n")
    return folder


def run(cmd: list[str], *, env_extra: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(cmd, cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], **kwargs)


def last_json_line(text: str):
    """The last stdout line that is a JSON object (FastVideo logs freely around it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{text[-3000:]}")


def video_frames_and_size(path: Path) -> tuple[int, tuple[int, int]]:
    """(frame count, (width, height)) of a video file, read back with ffmpeg."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    frames = sum(1 for _ in reader)
    return frames, tuple(meta["size"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forward_batch(args, model_path, **overrides):
    """A FastVideo `ForwardBatch` as `VideoGenerator` makes one, from the checkpoint's sampling defaults."""
    from fastvideo.api.sampling_param import SamplingParam
    from fastvideo.pipelines import ForwardBatch
    from fastvideo.utils import shallow_asdict

    sp = SamplingParam.from_pretrained(str(model_path))
    for key, value in overrides.items():
        setattr(sp, key, value)
    return ForwardBatch(**shallow_asdict(sp), eta=0.0, n_tokens=None, VSA_sparsity=args.VSA_sparsity)


# PAN2_TEST_DECODE=record:PATH: every decode_iter passes its chunks through and, when done, saves {latents it got, the
# video it yielded} to PATH. =record-then-fail:PATH: the same, then raises. =disk-full: the mp4 writer raises ENOSPC at
# its second frame.
DECODE_HOOK = textwrap.dedent("""
    import os

    _mode, _, _path = os.environ.get("PAN2_TEST_DECODE", "").partition(":")
    if _mode in ("record", "record-then-fail"):
        import torch
        from fastvideo_pan2_ext.vae_kernel import decoder as _decoder

        _original = _decoder.WanVAEDecoder.decode_iter

        def decode_iter(self, latents):
            chunks = _original(self, latents)  # plans at the call, as the caller expects

            def recording():
                video = []
                for item in chunks:
                    video.append(item[2])
                    yield item
                torch.save({"latents": latents.cpu(), "video": torch.cat(video, 2)}, _path)
                if _mode == "record-then-fail":
                    raise RuntimeError("injected decode failure")
            return recording()

        _decoder.WanVAEDecoder.decode_iter = decode_iter
    if _mode == "disk-full":  # the mp4 writer's disk fills up after the first frame
        import errno
        from fastvideo_pan2_ext.media import video_io

        _append = video_io._Mp4.append

        def append(self, frame, images):
            if self.frames:
                raise OSError(errno.ENOSPC, "No space left on device")
            _append(self, frame, images[:1])

        video_io._Mp4.append = append
""")


def decode_hook_env(tmp_path: Path, mode: str) -> dict[str, str]:
    """The environment (offline) under which every process of a run has `DECODE_HOOK` in `mode`: a `sitecustomize`
    in tmp_path/hook, on PYTHONPATH before the repository."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(DECODE_HOOK)
    return {**OFFLINE, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "PAN2_TEST_DECODE": mode}


@contextlib.contextmanager
def pan2_fast_decode(config, frames_per_pass: int = 2):
    """PAN2's fast decoder on (`config`: the pipeline's PAN2PipelineConfig) at `frames_per_pass` inside the block; its
    switches as they were after it."""
    saved = config.vae_decode_kernel, config.vae_decode_frames_per_pass
    config.vae_decode_kernel, config.vae_decode_frames_per_pass = True, frames_per_pass
    try:
        yield
    finally:
        config.vae_decode_kernel, config.vae_decode_frames_per_pass = saved
        config.check_vae_options()
