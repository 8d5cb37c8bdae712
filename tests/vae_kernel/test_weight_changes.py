"""The decoder sees every change of the VAE's weights (`weights.DecoderWeights`): whatever changed them, a decoder made
from the VAE earlier decodes what a decoder made from the VAE as it is now decodes (bit for bit: the same algorithm,
the same threads), directly, through diffusers' `enable_fast_decode` and through FastVideo's route; a decoder made
from a state dict keeps the values it was given."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _vae_helpers import fastvideo_wan_vae_of, make_wan22_vae, random_latents, randomize_parameters_
from diffusers.models.autoencoders.vae import DecoderOutput
from peft import LoraConfig, inject_adapter_in_model

from fastvideo_pan2_ext import enable_fast_decode
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.definitions.precision import exact_fp32
from fastvideo_pan2_ext.vae_kernel.portable import weights

Z = (1, 8, 1, 2, 3)  # one latent frame: one pass


def _plain_weights(vae) -> dict[str, torch.Tensor]:
    """A copy of the VAE's weights as they are now, under diffusers' names (a PEFT-wrapped layer's base weights as
    its own, its adapters dropped)."""
    return {k.replace(".base_layer.", "."): v.clone() for k, v in vae.state_dict().items() if ".lora_" not in k}


def _now(vae) -> WanVAEDecoder:
    """A decoder made from a copy of the VAE's weights as they are now."""
    return WanVAEDecoder(_plain_weights(vae), device="cpu", local=True)


def _conv1(vae) -> torch.nn.Parameter:
    return vae.decoder.up_blocks[0].resnets[0].conv1.weight


def _swap_conv_out(vae) -> None:
    vae.decoder.conv_out = randomize_parameters_(copy.deepcopy(vae.decoder.conv_out), 9)


def _wider_decoder(vae) -> None:  # a new architecture: the decoder of a VAE of twice the decoder width
    vae.decoder = make_wan22_vae(seed=4, decoder_base_dim=16).decoder


def _data_edits(vae) -> None:  # how PEFT's unsafe merge writes: through .data, which bumps no version counter
    _conv1(vae).data.mul_(0.5)
    vae.decoder.conv_out.bias.data.add_(0.25)  # a bias: the kind of tensor the decoder once shared with the VAE
    vae.post_quant_conv.weight.data.mul_(-1)


def _in_place(vae) -> None:
    with torch.no_grad():
        _conv1(vae).mul_(0.5)
        vae.decoder.norm_out.gamma.add_(1)


def _data_assigned(vae) -> None:
    _conv1(vae).data = _conv1(vae).data * 0.5


CHANGES = {
    "load_state_dict": lambda vae: vae.load_state_dict(make_wan22_vae(seed=5).state_dict()),
    "to_bfloat16": lambda vae: vae.to(torch.bfloat16),
    "module_swap": _swap_conv_out,
    "new_architecture": _wider_decoder,
    "in_place_ops": _in_place,
    "data_edits": _data_edits,
    "data_assigned": _data_assigned,
}


@pytest.fixture(scope="module")
def z():
    return random_latents(Z, seed=2)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_decoder_made_from_a_vae_decodes_its_weights_as_they_are_at_each_decode(change, z):
    vae = make_wan22_vae(seed=0)
    decoder = WanVAEDecoder(vae, device="cpu", local=True)
    before = {name: w.clone() for name, w in decoder.weights.items()}
    CHANGES[change](vae)
    video = decoder.decode(z)
    assert torch.equal(video, _now(vae).decode(z))
    assert any(not torch.equal(w, before[name]) for name, w in decoder.weights.items() if name in before)
    assert decoder.sync_weights() is False  # nothing changed since the decode


def test_data_edits_are_seen_on_either_kind_of_cpu_prepacked_or_not(cpu_compute, z):
    vae = make_wan22_vae(seed=0)
    decoder = WanVAEDecoder(vae, device="cpu", local=True)
    first = decoder.decode(z)
    _data_edits(vae)
    video = decoder.decode(z)
    assert not torch.equal(video, first) and torch.equal(video, _now(vae).decode(z))


def test_a_decoder_made_from_a_state_dict_keeps_the_values_it_was_given(z):
    vae = make_wan22_vae(seed=0)
    state_dict = vae.state_dict()  # views of the VAE's tensors
    decoder = WanVAEDecoder(state_dict, device="cpu", local=True)
    first = decoder.decode(z)
    _data_edits(vae)  # biases included
    assert torch.equal(decoder.decode(z), first)
    with pytest.raises(ValueError, match="made from a state dict"):
        decoder.release_weights()


def test_a_weight_changed_to_non_finite_values_is_refused_by_the_next_decode(z):
    vae = make_wan22_vae(seed=0)
    decoder = WanVAEDecoder(vae, device="cpu", local=True)
    vae.decoder.conv_out.bias.data[0] = float("nan")
    with pytest.raises(ValueError, match=r"state_dict\['decoder.conv_out.bias'\] has non-finite values"):
        decoder.decode(z)


# ----------------------------------------------------------------------------------------------- diffusers, FastVideo


def _fast(vae, z) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", "enable_fast_decode")  # the fast decoder, not diffusers' decode
        output = vae.decode(z)
    return output.sample if isinstance(output, DecoderOutput) else output


def test_diffusers_one_decoder_per_vae_whose_weights_follow_data_edits(z):
    vae = make_wan22_vae(seed=0)
    enable_fast_decode(vae)
    _fast(vae, z)
    decoder = vae.__dict__["_pan2_fast_decode"].worker
    _data_edits(vae)
    assert torch.equal(_fast(vae, z), _now(vae).decode(z).float())
    assert vae.__dict__["_pan2_fast_decode"].worker is decoder


def test_fastvideo_route_decodes_the_vae_weights_as_they_are_at_each_decode(z):
    vae = fastvideo_wan_vae_of(make_wan22_vae(seed=0), decode_kernel=True)
    _fast(vae, z)
    _data_edits(vae)
    assert torch.equal(_fast(vae, z), _now(vae).decode(z).float())
    vae.load_state_dict(make_wan22_vae(seed=5).state_dict())
    assert torch.equal(_fast(vae, z), _now(vae).decode(z).float())


LORA_TARGETS = ["decoder.mid_block.attentions.0.to_qkv", "decoder.up_blocks.0.upsampler.resample.1"]


def _lora_layers(vae) -> list:
    return [m for m in vae.modules() if hasattr(m, "base_layer") and hasattr(m, "merge")]


def test_peft_lora_merged_into_the_decoder_and_unmerged_again_is_what_the_fast_decoder_decodes(z):
    """PEFT's LoRA on the decoder's plain convs (the causal 3-D convs take none), merged the way `merge()` and
    diffusers' `fuse_lora` do it (`weight.data += delta`), then unmerged and disabled."""
    vae = make_wan22_vae(seed=0)
    original = _now(vae).decode(z).float()
    vae = inject_adapter_in_model(LoraConfig(r=2, target_modules=LORA_TARGETS, init_lora_weights=False), vae)
    enable_fast_decode(vae)
    for layer in _lora_layers(vae):
        layer.merge()
    merged = _fast(vae, z)
    assert torch.equal(merged, _now(vae).decode(z).float()) and not torch.equal(merged, original)
    with torch.no_grad(), exact_fp32():
        diffusers_merged = type(vae).decode(vae, z).sample  # through PEFT's merged layers
    release = make_wan22_vae(seed=0)  # the merged weights in diffusers' bf16 decode: the allowance's baseline
    release.load_state_dict(_plain_weights(vae))
    with torch.no_grad():
        baseline = release.to(torch.bfloat16).decode(z.bfloat16()).sample
    assert compare_to_reference("merged", merged, diffusers_merged, baseline, unit_range=True).ok
    for layer in _lora_layers(vae):
        layer.unmerge()
        layer.enable_adapters(False)
    unmerged = _fast(vae, z)
    assert torch.equal(unmerged, _now(vae).decode(z).float()) and not torch.equal(unmerged, merged)


def test_an_active_unmerged_lora_falls_back_to_diffusers_with_one_warning(z):
    vae = inject_adapter_in_model(LoraConfig(r=2, target_modules=LORA_TARGETS, init_lora_weights=False),
                                  make_wan22_vae(seed=0))
    enable_fast_decode(vae)
    with torch.no_grad(), pytest.warns(UserWarning, match="LoRA adapters that are active but not merged"):
        video = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(video, type(vae).decode(vae, z).sample)


def test_a_vae_with_unmerged_lora_still_moves(z):
    """The move hook asks only where the VAE's weights are: a VAE the fast decoder falls back on (active LoRA, not
    merged) moves and casts as diffusers' does, and decodes as diffusers' after."""
    vae = make_wan22_vae(seed=0)
    enable_fast_decode(vae)
    _fast(vae, z)  # the decoder exists, with its prepared weights
    vae = inject_adapter_in_model(LoraConfig(r=2, target_modules=LORA_TARGETS, init_lora_weights=False), vae)
    vae.to("cpu", torch.float32)
    with torch.no_grad(), pytest.warns(UserWarning, match="LoRA adapters that are active but not merged"):
        video = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(video, type(vae).decode(vae, z).sample)


PARTS = {"decoder": weights.DECODER, "encoder fp32": weights.encoder_part(torch.float32),
         "encoder bf16": weights.encoder_part(torch.bfloat16)}


@pytest.mark.slow
@pytest.mark.parametrize("vae_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_first_min", [1, weights.CPU_CHANNELS_FIRST_MIN])  # 1: every 3x3 conv channels first
@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_sync_sees_a_one_element_edit_of_any_weight_in_either_layout(part, channels_first_min, vae_dtype,
                                                                       cpu_compute, monkeypatch):
    """`sync` tells an unchanged conv weight without preparing it again where that is a re-layout (`_prepares_to`):
    every weight, edited through `.data` in its last element and put back, is seen both times and held as
    preparing it gives; and a sync of unchanged weights prepares only what is no re-layout (the gammas, biases,
    sub-pixel kernels and casts)."""
    monkeypatch.setattr(weights, "CPU_CHANNELS_FIRST_MIN", channels_first_min)
    vae = make_wan22_vae(seed=0).to(vae_dtype)
    cpu = torch.device("cpu")
    held = weights.DecoderWeights(vae, weights.checked(vae, PARTS[part]), cpu, True, PARTS[part])
    prepared = []
    real_prepared_on = weights._prepared_on
    monkeypatch.setattr(weights, "_prepared_on", lambda name, *args: prepared.append(name) or
                        real_prepared_on(name, *args))
    assert held.sync() is False
    relaid = {name for name, t in held.tensors.items()
              if PARTS[part].conv_dtype(name) == vae_dtype and t.dtype == vae_dtype}
    assert set(prepared) == set(held.tensors) - relaid
    if part == "encoder fp32" and vae_dtype == torch.float32:
        assert relaid == {name for name in held.tensors if not name.endswith((".gamma", ".bias"))}  # every conv
    for name in held.tensors:
        parameter = vae.get_parameter(name).data.view(-1)
        kept = parameter[-1].item()
        for value in (kept + 1, kept):
            parameter[-1] = value
            assert held.sync() is True, name
            fresh = real_prepared_on(name, vae.get_parameter(name), cpu, True, PARTS[part])
            assert torch.equal(held.tensors[name], fresh) and held.tensors[name].stride() == fresh.stride(), name
    assert held.sync() is False
