"""`python -m fastvideo_pan2_ext.decode` with the real thing: latents saved by real diffusers `WanPipeline` runs
(tiny random-weight checkpoints of the Wan2.2 TI2V and the Wan2.1 T2V layout, `output_type="latent"`: normalized)
decode to the pipeline's own video within the allowance; a single original-format Wan2.1 VAE file goes through
diffusers' own `from_single_file` conversion; every mistake is one line and exit code 2 before any decoding."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _pan2_helpers import OFFLINE, run, video_frames_and_size

from fastvideo_pan2_ext.commands import decode
from fastvideo_pan2_ext.media import latents_file
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference

SIZES = {"wan2.2-ti2v": (64, 96), "wan2.1-t2v": (32, 48)}  # 4 x 6 latent rows x columns in both layouts
FRAMES = 9


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from fastvideo_pan2_ext.demo.tiny_checkpoints import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("wan")
    return {layout: make_tiny_checkpoint(base / layout, seed=1, layout=layout) for layout in SIZES}


def _pipeline_run(checkpoint, layout, output_type, vae_dtype=torch.float32):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    pipe.vae.to(vae_dtype)
    pipe.set_progress_bar_config(disable=True)
    height, width = SIZES[layout]
    out = pipe(prompt="a cat on a sofa", height=height, width=width, num_frames=FRAMES, num_inference_steps=2,
               guidance_scale=1.0, generator=torch.Generator().manual_seed(5), output_type=output_type)
    return out.frames


@pytest.fixture
def recorded(monkeypatch):
    """What every decode_iter of this process yields, recorded as it passes through to the writer."""
    videos = []
    original = WanVAEDecoder.decode_iter

    def decode_iter(self, latents):
        chunks = []
        videos.append(chunks)
        for item in original(self, latents):
            chunks.append(item[2])
            yield item

    monkeypatch.setattr(WanVAEDecoder, "decode_iter", decode_iter)
    return videos


def _fps_of(video) -> float:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(video))
    try:
        return next(reader)["fps"]
    finally:
        reader.close()


def _main(argv, capsys):
    """Run the command in this process -> (exit code, stdout, stderr lines)."""
    try:
        code = decode.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if "error" in line or "Traceback" in line]


@pytest.mark.parametrize("layout", list(SIZES))
def test_latents_of_a_real_diffusers_pipeline_decode_to_its_own_video(checkpoints, layout, tmp_path, recorded, capsys):
    checkpoint = checkpoints[layout]
    latents = _pipeline_run(checkpoint, layout, "latent")  # normalized: diffusers de-normalizes only to decode
    saved = tmp_path / "z.pt"
    torch.save(latents, saved)
    video = tmp_path / "out.mp4"
    code, out, errors = _main([saved, "--vae", checkpoint, "-o", video, "--backend", "torch", "--device", "cpu",
                               "--frames-per-pass", "2"], capsys)
    assert code == 0 and errors == [], errors
    height, width = SIZES[layout]
    assert video_frames_and_size(video) == (FRAMES, (width, height))
    assert _fps_of(video) == {"wan2.2-ti2v": 24, "wan2.1-t2v": 16}[layout]  # the model's own frame rate
    candidate = torch.cat(recorded[0], 2)

    # The pipeline's own video ([B, F, C, H, W] in [0, 1]) in fp32, and the release way (its VAE in bf16).
    def own(vae_dtype):
        frames = _pipeline_run(checkpoint, layout, "pt", vae_dtype)
        return (frames.float().permute(0, 2, 1, 3, 4) * 2 - 1)

    report = compare_to_reference(f"decode command ({layout})", candidate, own(torch.float32), own(torch.bfloat16),
                                  unit_range=True)
    assert report.ok, str(report)


def _to_original_wan21(state_dict: dict) -> dict:
    """diffusers' key conversion (`convert_wan_vae_to_diffusers`) inverted, for the Wan2.1 layout: the names of the
    original Wan VAE checkpoint."""
    residual = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
                "conv2": "residual.6", "conv_shortcut": "shortcut"}

    def block(rest):
        for new, old in residual.items():
            if rest.startswith(new):
                return old + rest[len(new):]
        return rest

    out = {}
    for key, value in state_dict.items():
        k = key
        k = re.sub(r"^quant_conv\.", "conv1.", k)
        k = re.sub(r"^post_quant_conv\.", "conv2.", k)
        k = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", k)
        k = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", k)
        k = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", k)
        k = re.sub(r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.middle.1.", k)
        m = re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)$", k)
        if m:
            k = f"{m[1]}.middle.{2 * int(m[2])}.{block(m[3])}"
        m = re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", k)
        if m:
            k = f"encoder.downsamples.{m[1]}.{block(m[2])}"
        m = re.match(r"^decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.*)$", k)
        if m:
            k = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{block(m[3])}"
        m = re.match(r"^decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.*)$", k)
        if m:
            k = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[k] = value
    return out


def test_a_single_original_format_wan21_file_goes_through_diffusers_conversion(checkpoints, tmp_path, recorded,
                                                                              capsys):
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import save_file

    vae = AutoencoderKLWan.from_pretrained(str(checkpoints["wan2.1-t2v"] / "vae"))
    original = _to_original_wan21(vae.state_dict())
    converted = convert_wan_vae_to_diffusers(dict(original))
    assert converted.keys() == vae.state_dict().keys()  # the inversion is exact: diffusers maps it back
    single = tmp_path / "Wan2.1_VAE.safetensors"
    save_file({k: v.contiguous() for k, v in original.items()}, str(single))

    # A single file carries no latents_mean / latents_std: de-normalized latents (what the VAE's decode takes).
    z = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(3))
    torch.save(z, tmp_path / "z.pt")
    code, _, errors = _main([tmp_path / "z.pt", "--vae", single, "--denormalized", "-o", tmp_path / "v.mp4",
                             "--backend", "torch", "--device", "cpu"], capsys)
    assert code == 0 and errors == [], errors
    assert video_frames_and_size(tmp_path / "v.mp4") == (FRAMES, (48, 32))
    with torch.no_grad():
        fp32 = vae.decode(z).sample
        bf16 = AutoencoderKLWan.from_pretrained(str(checkpoints["wan2.1-t2v"] / "vae")).to(torch.bfloat16) \
            .decode(z.to(torch.bfloat16)).sample
    report = compare_to_reference("decode command, single file", torch.cat(recorded[0], 2), fp32, bf16,
                                  unit_range=True)
    assert report.ok, str(report)


def test_a_kept_latents_file_needs_no_other_argument(checkpoints, tmp_path, recorded, capsys):
    from diffusers import AutoencoderKLWan

    checkpoint = checkpoints["wan2.2-ti2v"]
    z = torch.randn(1, 48, 2, 4, 6, generator=torch.Generator().manual_seed(4))
    target = tmp_path / "videos" / "clip.mp4"
    target.parent.mkdir()
    kept = latents_file.write(latents_file.path_for(target), latents_file.KeptLatents(
        z, normalized=False, vae=str(checkpoint), layout="wan2.2", fps=12.0,
        decoder_options={"frames_per_pass": 1, "backend": "torch"}, output=str(target)))
    assert kept == tmp_path / "videos" / "clip.latents.safetensors"
    code, out, errors = _main([kept, "--device", "cpu"], capsys)
    assert code == 0 and errors == [], errors
    assert f"wrote 5 frames to {target}" in out
    assert video_frames_and_size(target) == (5, (96, 64))
    vae = AutoencoderKLWan.from_pretrained(str(checkpoint / "vae"))
    with torch.no_grad():
        fp32 = vae.decode(z).sample
        bf16 = vae.to(torch.bfloat16).decode(z.to(torch.bfloat16)).sample
    report = compare_to_reference("decode command, kept file", torch.cat(recorded[0], 2), fp32, bf16,
                                  unit_range=True)
    assert report.ok, str(report)


def test_mistakes_are_one_line_before_any_decoding(checkpoints, tmp_path, recorded, capsys):
    z22 = tmp_path / "z22.pt"
    torch.save(torch.randn(1, 48, 2, 4, 6), z22)
    flat = tmp_path / "flat.pt"
    torch.save(torch.randn(48, 2, 4, 6), flat)
    nan = tmp_path / "nan.pt"
    torch.save(torch.full((1, 48, 2, 4, 6), float("nan")), nan)
    text = tmp_path / "notes.txt"
    text.write_text("not a tensor")
    text_named_safetensors = tmp_path / "x.safetensors"
    text_named_safetensors.write_text("not a tensor either")
    existing = tmp_path / "existing.mp4"
    existing.write_bytes(b"a user's video")
    from diffusers import AutoencoderKLWan

    one_level = tmp_path / "one-level"  # a diffusers VAE with one temporal level: not a Wan VAE the decoder knows
    AutoencoderKLWan(base_dim=8, z_dim=48, temperal_downsample=[False, False, True]).save_pretrained(str(one_level))
    no_class = tmp_path / "no-class"
    no_class.mkdir()
    (no_class / "config.json").write_text("{}")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad_version = tmp_path / "old.latents.safetensors"
    latents_file.write(bad_version, latents_file.KeptLatents(torch.zeros(1, 48, 2, 4, 6), False, "x", "wan2.2", 24.0,
                                                             {}, "x.mp4"))
    from safetensors.torch import load_file, save_file

    from safetensors import safe_open

    with safe_open(str(bad_version), framework="pt") as f:
        metadata = {**f.metadata(), "format_version": "99"}
    save_file(load_file(str(bad_version)), str(bad_version), metadata=metadata)
    wan21, wan22 = checkpoints["wan2.1-t2v"], checkpoints["wan2.2-ti2v"]
    cases = [
        ([tmp_path / "missing.pt", "--vae", wan22], "missing.pt: no such file"),
        ([text, "--vae", wan22], "notes.txt: not a latents file: neither safetensors nor torch.save"),
        ([text_named_safetensors, "--vae", wan22], "x.safetensors: not a latents file"),
        ([flat, "--vae", wan22], "flat.pt: holds a torch.float32 tensor of shape [48, 2, 4, 6]; expected float latents"),
        ([nan, "--vae", wan22], "nan.pt: the latents contain NaN or Inf"),
        ([z22], "--vae PATH is needed"),
        ([z22, "--vae", wan21], "a VAE of 16 latent channels cannot decode latents of 48"),
        ([z22, "--vae", tmp_path], "neither a diffusers VAE folder"),
        ([z22, "--vae", text], "not a VAE checkpoint"),
        ([z22, "--vae", one_level], "decoder upsamples in time at 1 level(s); the Wan VAE's 4x temporal"),
        ([z22, "--vae", no_class], "config.json is not a diffusers model config (no _class_name), not a Wan VAE's"),
        ([z22, "--vae", wan22, "-o", a_file / "v.mp4"], f"the folder {a_file} is not a folder (create it first)"),
        ([z22, "--vae", wan22, "-o", tmp_path / "new" / "v.mp4"], f"the folder {tmp_path / 'new'} does not exist"),
        ([z22, "--vae", wan22, "-o", existing], "existing.mp4: the file exists; pass --overwrite (-y) to replace it"),
        ([z22, "--vae", wan22, "--fps", "inf"], "argument --fps: must be a positive number of frames per second"),
        ([z22, "--vae", wan22, "--fps", "nan"], "argument --fps: must be a positive number of frames per second"),
        ([z22, "--vae", wan22, "--fps", "0"], "argument --fps: must be a positive number of frames per second"),
        ([z22, "--vae", wan22, "--max-memory", "1KiB"], "1.0 KiB (1024 bytes) is too small"),
        ([z22, "--vae", wan22, "--backend", "cuda", "--device", "cpu"], "on the CPU use backend 'auto' or 'torch'"),
        ([z22, "--vae", wan22, "--device", "gpu0"], "got 'gpu0' (names are such as 'cuda', 'cuda:1', 'cpu')"),
        ([z22, "--vae", wan22, "-o", tmp_path / "v.gif"], "the output must be an .mp4 file"),
        ([z22, "--vae", wan22, "--frames-per-pass", "0"], "frames_per_pass must be 'auto' or an int >= 1"),
        ([z22, "--vae", wan22, "--tile-rows", "2", "--max-memory", "1GiB"], "not both"),
        ([bad_version], "format version '99'"),
        ([z22, "--vae", wan22, "--bogus"], "unrecognized arguments: --bogus"),
    ]
    for argv, expected in cases:
        code, out, errors = _main(argv, capsys)
        assert code == 2, (argv, code, out)
        assert len(errors) == 1 and errors[0].startswith(f"{decode.PROG}: error: ") and expected in errors[0], \
            (argv, errors)
    assert recorded == []  # nothing was decoded
    assert not (tmp_path / "v.mp4").exists() and not (tmp_path / "z22.mp4").exists()
    assert not (tmp_path / "new").exists()  # a missing folder is refused, not made
    assert existing.read_bytes() == b"a user's video"


@pytest.mark.slow
def test_the_real_command_refuses_in_one_line_without_a_traceback(tmp_path):
    torch.save(torch.randn(1, 48, 2, 4, 6), tmp_path / "z.pt")
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.decode", str(tmp_path / "z.pt"), "--vae",
                str(tmp_path / "nowhere")], env_extra=OFFLINE, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"{decode.PROG}: error: --vae {tmp_path / 'nowhere'}: no such file "
                                                "or folder"], proc.stderr
    assert not (tmp_path / "z.mp4").exists()

    # A missing output folder is refused by name, before the VAE is looked at: nothing is made.
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.decode", str(tmp_path / "z.pt"), "--vae",
                str(tmp_path / "nowhere"), "-o", str(tmp_path / "new" / "a.mp4")], env_extra=OFFLINE, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"{decode.PROG}: error: -o {tmp_path / 'new' / 'a.mp4'}: the folder "
                                                f"{tmp_path / 'new'} does not exist (create it first)"], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.pt"]  # nothing made, not even a probe


def _sparse_safetensors(path: Path, shape, dtype: str = "F32", metadata: dict | None = None) -> Path:
    """A safetensors file whose header declares `shape` of `dtype`, its data a hole (sparse: nothing on disk)."""
    size = math.prod(shape) * {"F32": 4, "F8_E4M3": 1}[dtype]
    header = {"latents": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, size]}}
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + size)
    return path


class _Reads:
    """safetensors' `safe_open`, recording which tensors were read from a file (the header is not a read)."""

    real = None

    def __init__(self, *args, **kwargs) -> None:
        self.handle = _Reads.real(*args, **kwargs)

    def __enter__(self):
        self.opened = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.opened, name)

    def get_tensor(self, name):
        READ.append(name)
        return self.opened.get_tensor(name)


READ: list[str] = []


def test_latents_are_judged_by_their_declared_shape_and_dtype_before_any_is_read(tmp_path, capsys, monkeypatch):
    import safetensors

    _Reads.real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", _Reads)
    READ.clear()
    monkeypatch.setattr(latents_file, "memory_left", lambda: 3 * 2**30)  # a 3 GiB limit, as the review's run had
    kept = {"format": latents_file.FORMAT, "format_version": latents_file.FORMAT_VERSION, "normalized": "false",
            "vae": "x", "vae_revision": "", "vae_dtype": "float32", "layout": "wan2.2", "fps": "24.0",
            "decoder_options": "{}", "output": "x.mp4", "frames": "5"}
    huge = (1, 48, 3 * 1024, 128, 128)  # 9 GiB of float32 latents declared, 18 GiB with their float32 copy
    torch.save(torch.zeros(1, 48, 2, 4, 6, dtype=torch.float8_e4m3fn), tmp_path / "f8.pt")
    cases = [
        (_sparse_safetensors(tmp_path / "huge.safetensors", huge),
         "huge.safetensors: latents [1, 48, 3072, 128, 128] of torch.float32 take 18.000 GiB with their float32 copy; "
         "this process can allocate 3.000 GiB more"),
        (_sparse_safetensors(tmp_path / "huge.latents.safetensors", huge, metadata=kept),
         "huge.latents.safetensors: latents [1, 48, 3072, 128, 128] of torch.float32 take 18.000 GiB"),
        (_sparse_safetensors(tmp_path / "f8.safetensors", (1, 48, 2, 4, 6), "F8_E4M3"),
         "f8.safetensors: holds a torch.float8_e4m3fn tensor of shape [1, 48, 2, 4, 6]; expected float latents "
         "[B, z_dim, T, h, w] of float32, bfloat16, float16 or float64"),
        (_sparse_safetensors(tmp_path / "f8.latents.safetensors", (1, 48, 2, 4, 6), "F8_E4M3", metadata=kept),
         "f8.latents.safetensors: holds a torch.float8_e4m3fn tensor"),
        (tmp_path / "f8.pt", "f8.pt: holds a torch.float8_e4m3fn tensor of shape [1, 48, 2, 4, 6]; expected float"),
    ]
    for latents, expected in cases:
        code, out, errors = _main([latents, "--vae", tmp_path / "nowhere"], capsys)
        assert code == 2 and len(errors) == 1 and expected in errors[0], (latents, code, errors)
    assert READ == []  # refused from the header: no tensor was read
    assert latents_file.memory_left.__name__ == "<lambda>" and monkeypatch.undo() is None
    assert 0 < latents_file.memory_left() < 2**50  # the real bound reads this machine (its available memory at least)


@pytest.mark.slow
@pytest.mark.parametrize("weights, says", [
    (None, "has a config.json but no weights (diffusion_pytorch_model.safetensors): is the download complete?"),
    (b"not safetensors", "cannot load it: Unable to load weights from checkpoint file"),
])
def test_a_broken_vae_folder_is_one_line_without_diffusers_own_log(checkpoints, tmp_path, weights, says):
    """diffusers logs its own lines (and huggingface_hub warns) before it raises on a folder without usable weights:
    the command's line is all the user sees."""
    torch.save(torch.randn(1, 48, 2, 4, 6), tmp_path / "z.pt")
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_bytes((checkpoints["wan2.2-ti2v"] / "vae" / "config.json").read_bytes())
    if weights is not None:
        (folder / "diffusion_pytorch_model.safetensors").write_bytes(weights)
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.decode", str(tmp_path / "z.pt"), "--vae", str(folder)],
               env_extra=OFFLINE, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{decode.PROG}: error: --vae {folder}: ") and says in lines[0], \
        proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae", "z.pt"]


def test_help_speaks_to_users_and_lists_the_exit_codes(capsys):
    code, out, _ = _main(["--help"], capsys)
    assert code == 0
    assert "--overwrite" in out and "-y" in out and "OUT_0.mp4" in out
    for exit_code in ("0", "1", "2", "130", "143"):
        assert re.search(rf"\b{exit_code} \w", out), (exit_code, out)
    assert "planning." not in out and "choose_plan" not in out  # no internals


def test_a_batch_writes_one_video_per_sample_and_never_replaces_one_unasked(checkpoints, tmp_path, recorded,
                                                                           capsys):
    z = torch.randn(2, 16, 2, 4, 6, generator=torch.Generator().manual_seed(6))
    torch.save(z, tmp_path / "z.pt")
    base = [tmp_path / "z.pt", "--vae", checkpoints["wan2.1-t2v"], "--denormalized", "--backend", "torch",
            "--device", "cpu", "--frames-per-pass", "2"]
    code, out, errors = _main([*base, "-o", tmp_path / "clip.mp4"], capsys)
    assert code == 0 and errors == [], errors
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["clip_0.mp4", "clip_1.mp4"]
    for b in range(2):  # each sample at its own size (32 x 48), not a padded, rescaled grid
        assert video_frames_and_size(tmp_path / f"clip_{b}.mp4") == (5, (48, 32))
        assert _fps_of(tmp_path / f"clip_{b}.mp4") == 16
    assert len(recorded) == 2  # one decode per sample
    assert not torch.equal(recorded[0][0], recorded[1][0])
    before = {b: (tmp_path / f"clip_{b}.mp4").read_bytes() for b in range(2)}

    code, _, errors = _main([*base, "-o", tmp_path / "clip.mp4", "--fps", "8"], capsys)
    assert code == 2 and errors == [f"{decode.PROG}: error: -o {tmp_path / 'clip_0.mp4'}: the file exists; pass "
                                    "--overwrite (-y) to replace it"], errors
    assert {b: (tmp_path / f"clip_{b}.mp4").read_bytes() for b in range(2)} == before and len(recorded) == 2

    code, _, errors = _main([*base, "-o", tmp_path / "clip.mp4", "--fps", "8", "-y"], capsys)
    assert code == 0 and errors == [], errors
    assert all(_fps_of(tmp_path / f"clip_{b}.mp4") == 8 for b in range(2))

    code, _, errors = _main([*base, "-o", tmp_path / "take-{}-final.mp4"], capsys)  # a pattern names them
    assert code == 0 and errors == [], errors
    assert sorted(p.name for p in tmp_path.glob("take-*.mp4")) == ["take-0-final.mp4", "take-1-final.mp4"]


def _stderr_lines(text: str) -> list[str]:
    """stderr without the progress bar's redraws."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip() and "VAE decode" not in line]


def _caught_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)[1], 16)


@pytest.mark.slow
@pytest.mark.parametrize("when, signum, to_group, code, word", [
    ("while torch loads", signal.SIGINT, True, 130, "interrupted"),
    ("mid-decode", signal.SIGINT, True, 130, "interrupted"),
    ("mid-decode", signal.SIGTERM, False, 143, "terminated"),
])
def test_a_signal_at_any_moment_leaves_no_file_and_one_line(checkpoints, tmp_path, when, signum, to_group, code,
                                                            word):
    """Ctrl-C reaches the whole process group (ffmpeg too); SIGTERM only the command."""
    torch.save(torch.randn(1, 16, 40, 4, 6), tmp_path / "z.pt")  # far more passes than it waits for
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fastvideo_pan2_ext.decode", str(tmp_path / "z.pt"), "--vae",
                             str(checkpoints["wan2.1-t2v"]), "--denormalized", "-o", str(out / "c.mp4"),
                             "--backend", "torch", "--device", "cpu", "--frames-per-pass", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        if when == "while torch loads":  # the command catches SIGTERM from its first lines on, seconds before main
            while not _caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:  # the first frames are in the partial file
            while not list(out.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr
    assert _stderr_lines(stderr) == [f"{decode.PROG}: error: {word}; no video written"], stderr
    assert stdout == "" and list(out.iterdir()) == []
