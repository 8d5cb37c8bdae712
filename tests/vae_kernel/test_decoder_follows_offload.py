"""Memory follows the VAE: when the VAE leaves a worker's device (`.to()`: how FastVideo's `vae_cpu_offload`, its
encoding stages and accelerate's model-offload hooks move it), the worker's prepared weights leave it too, and when
the VAE comes back the same worker prepares them again from it and computes the same result: the decoder and the
encoder alike, in both integrations (one mechanism: `Worker.follow_vae`, called by diffusers' `Route.vae_moved` and
FastVideo's `Workers.vae_moved`). A VAE offloaded layer by layer (accelerate's sequential offload) is decoded by
diffusers, after one warning.

No GPU here: the CPU stands in for the device, and the VAE leaves it for the meta device (where accelerate's
sequential offload keeps weights too). Bytes on the device are counted by the memory planner's tracker, `LiveBytes`,
restricted to the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from _vae_helpers import fastvideo_wan_vae_of, make_wan22_vae, random_latents
from accelerate import cpu_offload

from fastvideo_pan2_ext import enable_fast_decode, enable_fast_encode
from fastvideo_pan2_ext.vae_kernel.planning.memory import LiveBytes

Z = (1, 8, 1, 2, 3)
VIDEO = (1, 3, 1, 32, 48)  # Wan2.2: sides multiples of 16
CPU = torch.device("cpu")


def _decode(vae, z) -> torch.Tensor:
    with torch.no_grad():
        output = vae.decode(z)
    return getattr(output, "sample", output)


def _encode(vae, x) -> torch.Tensor:
    """The moments (diffusers' `AutoencoderKLOutput.latent_dist` or FastVideo's distribution: its `.parameters`)."""
    with torch.no_grad():
        output = vae.encode(x)
    return getattr(output, "latent_dist", output).parameters


def _offload_round_trip(vae, x, run, worker_of):
    """Run (`run(vae, x)`: a decode or an encode), move the VAE off the device and back with the same weights, run
    again: the bytes the run left on the device while the VAE was there and after it left, both results, the
    worker's prepared bytes, and whether the worker stayed the same."""
    saved = {k: v.clone() for k, v in vae.state_dict().items()}
    with LiveBytes(CPU) as tracker:
        first = run(vae, x)
        worker = worker_of(vae)
        result_bytes = first.untyped_storage().nbytes()
        while_there = tracker.bytes_alive() - result_bytes
        vae.to("meta")
        after_leaving = tracker.bytes_alive() - result_bytes
        weights_while_away = dict(worker.weights)
    vae.to_empty(device=CPU)
    vae.load_state_dict(saved)
    again = run(vae, x)
    weight_bytes = sum(w.untyped_storage().nbytes() for w in worker.weights.values())
    return while_there, after_leaving, weights_while_away, weight_bytes, first, again, worker_of(vae) is worker


def _diffusers_vae(work: str):
    vae = make_wan22_vae(seed=0)
    (enable_fast_decode if work == "decode" else enable_fast_encode)(vae)
    return vae


def _fastvideo_vae(work: str):
    return fastvideo_wan_vae_of(make_wan22_vae(seed=0), **{f"{work}_kernel": True}).requires_grad_(False)


def _diffusers_worker(work: str):
    return lambda v: v.__dict__[f"_pan2_fast_{work}"].worker


def _fastvideo_worker(work: str):
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode, fast_encode

    cache = fast_decode._decoders if work == "decode" else fast_encode._encoders
    return lambda v: cache[v][1]


@pytest.mark.parametrize("work", ["decode", "encode"])
@pytest.mark.parametrize("integration", ["diffusers", "fastvideo"])
def test_the_workers_weights_leave_the_device_with_the_vae_and_come_back_the_same(integration, work):
    vae = (_diffusers_vae if integration == "diffusers" else _fastvideo_vae)(work)
    worker_of = (_diffusers_worker if integration == "diffusers" else _fastvideo_worker)(work)
    x = random_latents(Z, seed=1) if work == "decode" else random_latents(VIDEO, seed=1).clamp(-1, 1)
    while_there, after_leaving, weights_while_away, weight_bytes, first, again, same = _offload_round_trip(
        vae, x, _decode if work == "decode" else _encode, worker_of)
    assert after_leaving == 0 and weights_while_away == {}
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
