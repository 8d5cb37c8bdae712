"""WanVAEDecoder's portable path on a Wan2.2-layout model, for what the shared suite does not cover: a batch decoded as
each sample alone, the diffusers module and bf16 latents as input, backend "auto" on CPU, the global TF32 flags.
The decode itself (the allowance against the fp32 reference, docs/design.md "Definitions", release = diffusers bf16;
frames per pass, tiles, max_memory, decode_iter, ranks) is tests/vae_kernel/test_decoder_variants.py, for both layouts and both
conv algorithms.

Narrow seeded random-weight Wan2.2 models on CPU; the oracle decodes are cached per latents so each runs once.
"""

from __future__ import annotations

import pytest
import torch

from _decoder_allowance import Oracle, check_allowance, latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder


@pytest.fixture(scope="module")
def oracle(wan22_vae, wan22_state_dict):
    return Oracle(wan22_vae, wan22_state_dict)


def _decode(state_dict, z, frames_per_pass):
    return WanVAEDecoder(state_dict, device="cpu", frames_per_pass=frames_per_pass, backend="torch").decode(z)


def test_batch_of_two_decodes_each_sample_as_alone(wan22_state_dict, oracle):
    shape = (2, 8, 3, 3, 2)
    z = latents(shape, seed=7)
    ref32, release = oracle.decodes(z, shape)
    video = _decode(wan22_state_dict, z, 2)
    check_allowance(video, ref32, release)
    for i in range(2):
        assert torch.equal(video[i:i + 1], _decode(wan22_state_dict, z[i:i + 1], 2))


def test_decoder_takes_the_diffusers_module_and_bf16_latents(wan22_vae, wan22_state_dict, oracle):
    shape = (1, 8, 2, 2, 2)
    z = latents(shape, seed=3)
    ref32, release = oracle.decodes(z, shape)
    from_module = WanVAEDecoder(wan22_vae, device="cpu", backend="torch").decode(z)
    assert torch.equal(from_module, _decode(wan22_state_dict, z, 4))
    # bf16 latents: the caller's rounding of z is the only difference, still inside the allowance.
    check_allowance(_decode(wan22_state_dict, z.to(torch.bfloat16), 4), ref32, release)


def test_auto_backend_on_cpu_never_tries_the_compiled_one(wan22_state_dict, monkeypatch):
    """A CPU decode must not build or load the CUDA extension (a build takes minutes and needs nvcc)."""
    from fastvideo_pan2_ext.vae_kernel import backends

    def refuse(*args, **kwargs):
        raise AssertionError("backend='auto' on CPU tried to load the compiled decoder")

    monkeypatch.setattr(backends, "load_ops", refuse)
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu")
    assert decoder.backend == "torch"
    z = latents((1, 8, 2, 1, 2), seed=5)
    assert torch.equal(decoder.decode(z), _decode(wan22_state_dict, z, 4))  # the portable ops, the same call


def test_decode_leaves_global_tf32_flags_as_they_were(wan22_state_dict):
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    _decode(wan22_state_dict, latents((1, 8, 1, 1, 1), seed=0), 1)
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == saved
