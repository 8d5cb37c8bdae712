"""`python -m fastvideo_pan2_ext.decode` with the real thing: latents saved by real diffusers `WanPipeline` runs
(tiny random-weight checkpoints of the Wan2.2 TI2V and the Wan2.1 T2V layout, `output_type="latent"`: normalized)
decode to the pipeline's own video within the allowance; a single original-format Wan2.1 VAE file goes through
diffusers' own `from_single_file` conversion; every mistake is one line and exit code 2 before any decoding."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from _pan2_helpers import OFFLINE, run, video_frames_and_size

from fastvideo_pan2_ext import decode, latents_file
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
        ([text, "--vae", wan22], "notes.txt: not a tensor file"),
        ([flat, "--vae", wan22], "flat.pt: holds a torch.float32 tensor of shape [48, 2, 4, 6]; expected float latents"),
        ([nan, "--vae", wan22], "nan.pt: the latents contain NaN or Inf"),
        ([z22], "--vae PATH is needed"),
        ([z22, "--vae", wan21], "a VAE of 16 latent channels cannot decode latents of 48"),
        ([z22, "--vae", tmp_path], "neither a diffusers VAE folder"),
        ([z22, "--vae", text], "not a VAE checkpoint"),
        ([z22, "--vae", wan22, "-o", a_file / "v.mp4"], "cannot write the video to"),
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


def test_the_real_command_refuses_in_one_line_without_a_traceback(tmp_path):
    torch.save(torch.randn(1, 48, 2, 4, 6), tmp_path / "z.pt")
    proc = run([sys.executable, "-m", "fastvideo_pan2_ext.decode", str(tmp_path / "z.pt"), "--vae",
                str(tmp_path / "nowhere")], env_extra=OFFLINE, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"{decode.PROG}: error: --vae {tmp_path / 'nowhere'}: no such file "
                                                "or folder"], proc.stderr
    assert not (tmp_path / "z.mp4").exists()
