"""The kept-latents file (`fastvideo_pan2_ext.latents_file`): a round trip keeps every field, a failed write leaves
nothing, and a file that is not one (or is damaged) is one clear error."""

from __future__ import annotations

import os

import pytest
import torch

from fastvideo_pan2_ext import latents_file
from fastvideo_pan2_ext.latents_file import KeptLatents, LatentsFileError


def _kept(**changes) -> KeptLatents:
    fields = dict(latents=torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(0)), normalized=False,
                  vae="/models/pan2", layout="wan2.2", fps=24.0,
                  decoder_options={"frames_per_pass": 2, "tile_rows": None, "max_memory": "2GiB"},
                  output="/videos/clip.mp4")
    return KeptLatents(**{**fields, **changes})


def test_a_round_trip_keeps_every_field(tmp_path):
    kept = _kept()
    path = latents_file.write(latents_file.path_for(tmp_path / "clip.mp4"), kept)
    assert path == tmp_path / "clip.latents.safetensors" and os.listdir(tmp_path) == [path.name]
    back = latents_file.read(path)
    assert torch.equal(back.latents, kept.latents)
    assert (back.normalized, back.vae, back.layout, back.fps, back.decoder_options, back.output, back.frames) == \
        (False, "/models/pan2", "wan2.2", 24.0, kept.decoder_options, "/videos/clip.mp4", 9)


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        latents_file.write(tmp_path / "clip.latents.safetensors", _kept())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("change, message", [
    (dict(layout="wan3"), "layout must be one of wan2.2, wan2.1"),
    (dict(fps=0), "fps must be a positive number"),
    (dict(latents=torch.zeros(48, 3, 4, 6)), "latents must be a float tensor [B, z_dim, T, h, w]"),
    (dict(decoder_options={"frames_per_pass": 0}), "decoder_options: frames_per_pass must be 'auto'"),
    (dict(decoder_options={"speed": "max"}), r"decoder_options: unknown decoder option\(s\) speed"),
    (dict(normalized="no"), "normalized must be a bool"),
])
def test_what_cannot_be_decoded_is_not_written(tmp_path, change, message):
    with pytest.raises(LatentsFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        latents_file.write(tmp_path / "x.latents.safetensors", _kept(**change))
    assert os.listdir(tmp_path) == []


def test_files_that_are_not_kept_latents_are_one_line_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    text = tmp_path / "notes.latents.safetensors"
    text.write_text("hello")
    plain = tmp_path / "plain.safetensors"
    save_file({"latents": torch.zeros(1, 48, 2, 4, 6)}, str(plain))
    good = latents_file.write(tmp_path / "good.latents.safetensors", _kept())
    wrong_frames = tmp_path / "frames.latents.safetensors"
    from safetensors import safe_open

    with safe_open(str(good), framework="pt") as f:
        metadata = f.metadata()
    save_file(load_file(str(good)), str(wrong_frames), metadata={**metadata, "frames": "10"})
    two = tmp_path / "two.latents.safetensors"
    save_file({**load_file(str(good)), "extra": torch.zeros(1)}, str(two), metadata=metadata)
    for path, message in [(tmp_path / "missing.latents.safetensors", "no such file"),
                          (text, "not a safetensors file"), (plain, "not a kept-latents file"),
                          (wrong_frames, "metadata says 10 frames; 3 latent frames make 9"),
                          (two, "must hold exactly one tensor")]:
        with pytest.raises(LatentsFileError) as info:
            latents_file.read(path)
        assert str(info.value).startswith(str(path)) and message in str(info.value), str(info.value)
        assert "\n" not in str(info.value)


def test_the_decode_command_line_quotes_the_path():
    assert latents_file.decode_command("/v/my clip.latents.safetensors") == \
        "python -m fastvideo_pan2_ext.decode '/v/my clip.latents.safetensors'"
