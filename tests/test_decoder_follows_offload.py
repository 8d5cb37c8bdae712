"""Memory follows the VAE: when the VAE leaves the decoder's device (`.to()`: how FastVideo's `vae_cpu_offload` and
accelerate's model-offload hooks move it), the decoder's prepared weights leave it too, and when the VAE comes back the
same decoder prepares them again from it and decodes the same video. A VAE offloaded layer by layer (accelerate's
sequential offload) is decoded by diffusers, after one warning.

No GPU here: the CPU stands in for the device, and the VAE leaves it for the meta device (where accelerate's
sequential offload keeps weights too). Bytes on the device are counted by the memory planner's tracker, `LiveBytes`,
restricted to the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from _vae_helpers import fastvideo_wan_vae_of, make_wan22_vae, random_latents
from accelerate import cpu_offload

from fastvideo_pan2_ext import enable_fast_decode
from fastvideo_pan2_ext.vae_kernel.planning.memory import LiveBytes

Z = (1, 8, 1, 2, 3)
CPU = torch.device("cpu")


def _decode(vae, z) -> torch.Tensor:
    with torch.no_grad():
        output = vae.decode(z)
    return getattr(output, "sample", output)


def _offload_round_trip(vae, z, decoder_of):
    """Decode, move the VAE off the device and back with the same weights, decode again: the bytes the decode left on
    the device while the VAE was there and after it left, both videos, and whether the decoder stayed the same."""
    saved = {k: v.clone() for k, v in vae.state_dict().items()}
    with LiveBytes(CPU) as tracker:
        first = _decode(vae, z)
        decoder = decoder_of(vae)
        video_bytes = first.untyped_storage().nbytes()
        while_there = tracker.bytes_alive() - video_bytes
        vae.to("meta")
        after_leaving = tracker.bytes_alive() - video_bytes
    vae.to_empty(device=CPU)
    vae.load_state_dict(saved)
    again = _decode(vae, z)
    weight_bytes = sum(w.untyped_storage().nbytes() for w in decoder.weights.values())
    return while_there, after_leaving, weight_bytes, first, again, decoder_of(vae) is decoder


def test_diffusers_decoder_weights_leave_the_device_with_the_vae_and_come_back_the_same():
    vae = make_wan22_vae(seed=0)
    enable_fast_decode(vae)
    z = random_latents(Z, seed=1)
    while_there, after_leaving, weight_bytes, first, again, same = _offload_round_trip(
        vae, z, lambda v: v.__dict__["_pan2_fast_decode"].worker)
    assert after_leaving == 0
    assert while_there >= weight_bytes > 0
    assert same and torch.equal(again, first)


def test_fastvideo_decoder_weights_leave_the_device_with_the_vae_and_come_back_the_same():
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode

    vae = fastvideo_wan_vae_of(make_wan22_vae(seed=0), decode_kernel=True)
    z = random_latents(Z, seed=1)
    while_there, after_leaving, weight_bytes, first, again, same = _offload_round_trip(
        vae, z, lambda v: fast_decode._decoders[v][1])
    assert after_leaving == 0
    assert while_there >= weight_bytes > 0
    assert same and torch.equal(again, first)


def test_a_vae_offloaded_layer_by_layer_is_decoded_by_diffusers_after_one_warning():

    reference = make_wan22_vae(seed=0)
    vae = make_wan22_vae(seed=0)
    cpu_offload(vae, CPU)  # what diffusers' enable_sequential_cpu_offload does to each model
    enable_fast_decode(vae)
    z = random_latents(Z, seed=1)
    with pytest.warns(UserWarning, match="offloaded layer by layer"):
        video = _decode(vae, z)
    assert torch.equal(video, _decode(reference, z))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _decode(vae, z)
    assert torch.equal(again, video) and not [w for w in caught if "enable_fast_decode" in str(w.message)]
