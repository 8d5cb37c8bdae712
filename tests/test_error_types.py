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
    from fastvideo_pan2_ext.image import ImageInputError, load_image
    from fastvideo_pan2_ext.integration.checkpoint import NotPAN2CheckpointError, check_pan2_checkpoint

    with pytest.raises(ValueError) as raised:
        load_image(tmp_path / "missing.png")
    assert isinstance(raised.value, ImageInputError)
    with pytest.raises(ValueError) as raised:
        check_pan2_checkpoint(str(tmp_path))
    assert isinstance(raised.value, NotPAN2CheckpointError)


def test_an_unwritable_output_folder_is_an_os_error(tmp_path):
    from fastvideo_pan2_ext.video_io import check_writable

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match="cannot write the video to"):
        check_writable(blocker / "sub" / "video.mp4")  # its folder would have to be inside a file


def test_a_fastvideo_without_a_seam_is_a_runtime_error(monkeypatch):
    import fastvideo.registry

    from fastvideo_pan2_ext.integration import adapter

    monkeypatch.delattr(fastvideo.registry, "_CONFIG_REGISTRY")  # what a FastVideo that renamed it looks like
    with pytest.raises(RuntimeError, match=r"needs fastvideo\.registry\._CONFIG_REGISTRY") as raised:
        adapter.check()
    assert isinstance(raised.value, adapter.IncompatibleFastVideo)
