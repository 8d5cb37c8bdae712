"""The kept-latents file (`fastvideo_pan2_ext.media.latents_file`): a round trip keeps every field, the file is created as
any new file of the process (the umask decides its mode) and reaches the disk before its name does, a failed write
leaves nothing, a file that is not one (or is damaged) is one clear error, and the decode command it prints can be
pasted into a shell."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys

import pytest
import torch

from fastvideo_pan2_ext.media import latents_file
from fastvideo_pan2_ext.media.latents_file import KeptLatents, LatentsFileError


def _kept(**changes) -> KeptLatents:
    fields = dict(latents=torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(0)), normalized=False,
                  vae="/models/pan2", layout="wan2.2", fps=24.0,
                  decoder_options={"frames_per_pass": 2, "tile_rows": None, "max_memory": "2GiB"},
                  output="/videos/clip.mp4")
    return KeptLatents(**{**fields, **changes})


@pytest.mark.parametrize("vae, revision, dtype", [("/models/pan2", None, "float32"),
                                                   ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "0123abcd" * 5, "bfloat16")])
def test_a_round_trip_keeps_every_field(tmp_path, vae, revision, dtype):
    kept = _kept(vae=vae, vae_revision=revision, vae_dtype=dtype)
    path = latents_file.write(latents_file.path_for(tmp_path / "clip.mp4"), kept)
    assert path == tmp_path / "clip.latents.safetensors" and os.listdir(tmp_path) == [path.name]
    back = latents_file.read(path)
    assert torch.equal(back.latents, kept.latents)
    assert (back.normalized, back.vae, back.vae_revision, back.vae_dtype, back.layout, back.fps, back.decoder_options,
            back.output, back.frames) == \
        (False, vae, revision, dtype, "wan2.2", 24.0, kept.decoder_options, "/videos/clip.mp4", 9)
    assert back.torch_vae_dtype == getattr(torch, dtype)


def test_the_file_is_created_as_the_umask_says(tmp_path):
    """A process with umask 027 creates its files 0640 (0666 & ~027): the kept file too, as any other."""
    code = ("import sys, torch\n"
            "from fastvideo_pan2_ext.media import latents_file\n"
            "latents_file.write(sys.argv[1], latents_file.KeptLatents(torch.zeros(1, 48, 1, 2, 2), False, '/m', "
            "'wan2.2', 24.0, {}, '/v.mp4'))\n")
    path = tmp_path / "clip.latents.safetensors"
    proc = subprocess.run(["sh", "-c", 'umask 027 && exec "$0" -c "$1" "$2"', sys.executable, code, str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert latents_file.read(path).frames == 1


def test_the_file_reaches_the_disk_before_its_name_and_the_name_after(tmp_path, monkeypatch):
    """fsync of the file's bytes, then the rename, then fsync of the folder (which makes the rename durable)."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    path = latents_file.write(tmp_path / "clip.latents.safetensors", _kept())
    file, folder = path.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", file), ("replace", file), ("fsync", folder)]


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(fd):  # where a full disk shows up when the file system allocates late
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
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
    (dict(vae_dtype="int8"), "vae_dtype must be one of float32, bfloat16, float16"),
    (dict(vae_revision=""), "vae_revision must be a hub revision or None"),
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


def test_the_decode_command_runs_this_interpreter_and_quotes_what_a_shell_would_split(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/my envs/bin/python3")
    line = latents_file.decode_command("/v/it's my clip.latents.safetensors")
    assert shlex.split(line) == ["/opt/my envs/bin/python3", "-m", "fastvideo_pan2_ext.decode",
                                 "/v/it's my clip.latents.safetensors"]
    proc = subprocess.run(["sh", "-c", f"set -- {line}; printf '%s\\n' \"$@\""], capture_output=True, text=True)
    assert proc.stdout.splitlines() == shlex.split(line)  # a real shell splits it the same way
