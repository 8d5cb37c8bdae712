"""WanVAEDecoder refuses bad input up front with a ValueError naming the value (no partial output, no hang)."""

from __future__ import annotations

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder, select_ops


@pytest.fixture(scope="module")
def decoder(wan22_state_dict):
    return WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")


def _nan_at(shape, index, value):
    z = torch.zeros(shape)
    z[index] = value
    return z


@pytest.mark.parametrize(
    "z, message",
    [
        (torch.zeros(1, 8, 2, 3), r"latents must be \[B, 8, T, H, W\]; got \[1, 8, 2, 3\]"),
        (torch.zeros(1, 16, 2, 3, 3), r"latents must be \[B, 8, T, H, W\]; got \[1, 16, 2, 3, 3\]"),
        (torch.zeros(1, 8, 0, 3, 3), r"every dimension >= 1; got \[1, 8, 0, 3, 3\]"),
        (torch.zeros(1, 8, 2, 3, 3, dtype=torch.int32), r"floating-point tensor; got torch.int32"),
        (torch.zeros(1, 8, 2, 3, 3, dtype=torch.float8_e4m3fn), r"latents must be float32, bfloat16, float16 or float64"),
        (_nan_at((1, 8, 2, 3, 3), (0, 5, 1, 2, 0), float("nan")), "NaN or Inf"),
        (_nan_at((1, 8, 2, 3, 3), (0, 0, 0, 0, 0), float("-inf")), "NaN or Inf"),
        ([[0.0]], "latents must be a torch.Tensor; got list"),
        (torch.zeros(1, 8, 2, 3, 3, device="meta"), "latents are on meta; this decoder runs on cpu"),
    ],
    ids=["rank4", "channels", "T0", "int", "float8", "nan", "inf", "list", "device"],
)
def test_bad_latents_raise_before_any_output(decoder, z, message):
    with pytest.raises(ValueError, match=message):
        decoder.decode(z)
    with pytest.raises(ValueError, match=message):
        decoder.decode_iter(z)  # raises on the call, before a first chunk exists


@pytest.mark.parametrize("frames_per_pass", [0, -1, 1.5, True, "4", "Auto", None])
def test_frames_per_pass_must_be_auto_or_a_positive_int(wan22_state_dict, frames_per_pass):
    with pytest.raises(ValueError, match=r"frames_per_pass must be 'auto' or an int >= 1; got"):
        WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=frames_per_pass)


def test_missing_weight_is_named(wan22_state_dict):
    sd = dict(wan22_state_dict)
    del sd["decoder.up_blocks.1.resnets.2.conv2.bias"]
    with pytest.raises(ValueError, match=r"missing 'decoder.up_blocks.1.resnets.2.conv2.bias'"):
        WanVAEDecoder(sd, device="cpu")


def test_misshapen_weight_is_named(wan22_state_dict):
    sd = dict(wan22_state_dict)
    sd["decoder.mid_block.attentions.0.proj.weight"] = torch.zeros(32, 32, 1, 2)
    with pytest.raises(ValueError, match=r"proj.weight'\] has shape \[32, 32, 1, 2\]; expected \[32, 32, 1, 1\]"):
        WanVAEDecoder(sd, device="cpu")


def test_non_finite_weight_is_named(wan22_state_dict):
    sd = dict(wan22_state_dict)
    bad = sd["decoder.conv_in.weight"].clone()
    bad[0, 0, 0, 0, 0] = float("inf")
    sd["decoder.conv_in.weight"] = bad
    with pytest.raises(ValueError, match=r"decoder.conv_in.weight'\] has non-finite values"):
        WanVAEDecoder(sd, device="cpu")


def test_not_a_model_or_state_dict_is_refused():
    with pytest.raises(ValueError, match="got int"):
        WanVAEDecoder(3, device="cpu")


@pytest.mark.parametrize("backend, device, error, message", [
    ("bogus", "cpu", ValueError, r"backend must be one of \['auto', 'cuda', 'torch'\]; got 'bogus'"),
    ("cuda", "cpu", ValueError, r"backend='cuda' needs a CUDA device; got device cpu"),
])
def test_bad_backend_is_refused(wan22_state_dict, backend, device, error, message):
    with pytest.raises(error, match=message):
        WanVAEDecoder(wan22_state_dict, device=device, backend=backend)


def test_bad_device_is_refused(wan22_state_dict):
    with pytest.raises(ValueError, match="device must be a torch device or its name; got 'gpu0'"):
        WanVAEDecoder(wan22_state_dict, device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less behaviour")
def test_cuda_device_without_cuda_is_refused(wan22_state_dict):
    with pytest.raises(ValueError, match="device cuda requested but CUDA is not available"):
        WanVAEDecoder(wan22_state_dict, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less behaviour")
def test_compiled_backend_unavailable_is_a_clear_error_and_auto_falls_back():
    device = torch.device("cuda", 0)  # a device object only: nothing runs on it
    with pytest.raises(RuntimeError, match=r"the compiled CUDA decoder is not available on cuda:0: "):
        select_ops("cuda", device)
    assert select_ops("auto", device).name == "torch"
