"""The error types docs/design.md ("Public API") promises: a bad value is a `ValueError` (the package's own
error classes derive from it), a valid request this machine cannot serve is a `RuntimeError`, an output folder that
cannot be written is an `OSError`. Each is raised the way a user meets it; a missing GPU is the only fault injected
(by asking for a CUDA device on a machine without one)."""

from __future__ import annotations

import logging

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder, backends
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable CUDA GPU")


def test_bad_decoder_values_are_value_errors(wan22_state_dict):
    for options, message in [({"backend": "cudnn"}, "backend must be one of"),
                             ({"conv_algorithm": "fft"}, "conv_algorithm must be one of"),
                             ({"frames_per_pass": 0}, "frames_per_pass must be 'auto' or an int >= 1"),
                             ({"backend": "cuda"}, "backend='cuda' needs a CUDA device")]:
        with pytest.raises(ValueError, match=message):
            WanVAEDecoder(wan22_state_dict, device="cpu", **options)


@needs_no_gpu
def test_a_cuda_device_without_cuda_is_a_value_error(wan22_state_dict):
    with pytest.raises(ValueError, match="device cuda requested but CUDA is not available"):
        WanVAEDecoder(wan22_state_dict, device="cuda")


@needs_no_gpu
def test_backend_cuda_where_the_compiled_decoder_cannot_load_is_a_runtime_error():
    """A valid request the machine cannot serve: "cuda" raises, naming why; "auto" runs the portable ops."""
    with pytest.raises(RuntimeError, match="the compiled CUDA decoder is not available on cuda"):
        backends.select_ops("cuda", torch.device("cuda"))


@needs_no_gpu
def test_backend_auto_where_the_compiled_decoder_cannot_load_runs_the_portable_ops(caplog):
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        assert backends.select_ops("auto", torch.device("cuda")) is TORCH_OPS
    assert "compiled VAE decoder unavailable on cuda" in caplog.text


def test_image_and_checkpoint_errors_are_value_errors(tmp_path):
    from fastvideo_pan2_ext.media.image import ImageInputError, load_image
    from fastvideo_pan2_ext.fastvideo_integration.checkpoint import NotPAN2CheckpointError, check_pan2_checkpoint

    with pytest.raises(ValueError) as raised:
        load_image(tmp_path / "missing.png")
    assert isinstance(raised.value, ImageInputError)
    with pytest.raises(ValueError) as raised:
        check_pan2_checkpoint(str(tmp_path))
    assert isinstance(raised.value, NotPAN2CheckpointError)


def test_an_unwritable_output_folder_is_an_os_error(tmp_path):
    from fastvideo_pan2_ext.media.video_io import check_writable

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match="cannot write the video to"):
        check_writable(blocker / "sub" / "video.mp4")  # its folder would have to be inside a file


def test_a_fastvideo_without_a_seam_is_a_runtime_error(monkeypatch):
    import fastvideo.registry

    from fastvideo_pan2_ext.fastvideo_integration import compat

    monkeypatch.delattr(fastvideo.registry, "_CONFIG_REGISTRY")  # what a FastVideo that renamed it looks like
    with pytest.raises(RuntimeError, match=r"needs fastvideo\.registry\._CONFIG_REGISTRY") as raised:
        compat.check()
    assert isinstance(raised.value, compat.IncompatibleFastVideo)


def test_one_line_of_an_error_is_first_lines_everywhere_and_an_empty_message_names_its_type(tmp_path, monkeypatch,
                                                                                            capsys):
    """Every message that quotes an error quotes `first_line(exc)` (one definition); an error with no message (an
    `OSError()` from a loader, say) is named by its type, never an IndexError of its own."""
    import re
    from pathlib import Path

    from diffusers import AutoencoderKLWan

    from fastvideo_pan2_ext.commands import decode
    from fastvideo_pan2_ext.vae_kernel.errors import first_line

    assert (first_line(OSError()), first_line(ValueError(" \n")), first_line(RuntimeError("a\nb"), with_type=True)) == \
        ("OSError", "ValueError", "RuntimeError: a")
    repo = Path(__file__).resolve().parents[2]
    spelled = [f"{path.relative_to(repo)}:{n}" for room in ("fastvideo_pan2_ext", "configs", "attention", "vae_kernel")
               for path in (repo / room).rglob("*.py") if path.name != "errors.py"
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"str\(\w+\)(\.strip\(\))?\.splitlines\(\)", line)]
    assert spelled == [], "quote an error with vae_kernel.errors.first_line"

    vae = tmp_path / "vae"
    vae.mkdir()
    (vae / "config.json").write_text('{"_class_name": "AutoencoderKLWan"}')
    (vae / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    torch.save(torch.zeros(1, 48, 2, 4, 6), tmp_path / "z.pt")

    def empty(*args, **kwargs):
        raise OSError()

    monkeypatch.setattr(AutoencoderKLWan, "from_pretrained", empty)
    with pytest.raises(SystemExit) as exited:
        decode.main([str(tmp_path / "z.pt"), "--vae", str(vae)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"{decode.PROG}: error: --vae {vae}: cannot load it: "
                                                            "OSError"]


def test_float8_weights_are_a_value_error_not_a_crash(wan22_state_dict):
    """No arithmetic of torch's takes float8 (its `isfinite` included): such weights are refused by name."""
    float8 = {name: tensor.to(torch.float8_e4m3fn) for name, tensor in wan22_state_dict.items()}
    with pytest.raises(ValueError, match=r"is torch\.float8_e4m3fn; the weights must be float32, bfloat16, float16 or "
                                         r"float64$"):
        WanVAEDecoder(float8, device="cpu")
