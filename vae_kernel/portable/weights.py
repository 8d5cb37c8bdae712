"""The decoder's weights: validation, their order, and the layouts the ops consume (prepared once).

`weight_names(config)` lists every tensor the decoder reads, in execution order (architecture.expected_shapes's order);
`decoder_weights(state_dict)` returns them prepared, in that order — the list a compiled kernel consumes:

| tensor                                   | prepared as                                                         |
|------------------------------------------|---------------------------------------------------------------------|
| conv weight [Co, Ci, kt, kh, kw]         | bf16 [Co, kt, kh, kw, Ci] (channels last); 2-D [Co, Ci, 1, 1] too   |
| upsampler `*.resample.1.weight` [Co, Ci, 3, 3] | bf16 [2, 2, Co, 2, 2, Ci]: the four 2x2 sub-pixel kernels    |
| `post_quant_conv.weight`                 | fp32 [Co, 1, 1, 1, Ci] (applied in fp32 to the caller's latents)    |
| bias [Co]                                | fp32 [Co]                                                           |
| RMS-norm gamma [C, 1, 1(, 1)]            | fp32 [C], multiplied by sqrt(C) (Wan's RMS_norm scale)              |

On a CPU that computes the convs in fp32 (`ops.compute_dtype`: one without AMX-BF16), `load` goes one step further
(`to_compute_layout`): the bf16 weights are held as fp32 (the same bf16-rounded values, converted once here instead
of on every call), and the 3x3 convs whose input and output both have at least `CPU_CHANNELS_FIRST_MIN` channels are
laid out channels first (the same logical [Co, kt, kh, kw, Ci], strides of a contiguous [Co, Ci, kt, kh, kw]), which
the conv op follows: oneDNN's fp32 conv runs those shapes faster channels first, the narrower and 1x1 ones channels
last (measured per shape: bench/results/cpu-conv-layouts-2026-12-01.json). A CPU with AMX-BF16 computes in bf16, as a
GPU does, and its convs are fastest channels last at every shape: it takes the weights as prepared, and `load`
prepacks each conv's weight for oneDNN (`ops.prepack`).
"""

from __future__ import annotations

import torch

from ..definitions.architecture import WAN22_CONFIG, WanVAEConfig, expected_shapes, infer_config
from ..definitions.precision import own_arithmetic
from . import ops

# Taps of nearest-2x + 3x3 conv seen from the low-resolution input: output phase a reads low-res offsets (a - 1, a)
# with kernel rows combined as below (phase 0: w0 | w1 + w2; phase 1: w0 + w1 | w2).
_SUBPIXEL_TAPS = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]],
                               [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])


def weight_names(config: WanVAEConfig | None = None) -> list[str]:
    """Every tensor the decoder reads, in execution order (default: the real Wan2.2 decoder)."""
    return list(expected_shapes(config or WAN22_CONFIG))


def subpixel_weights(w: torch.Tensor) -> torch.Tensor:
    """[Co, Ci, 3, 3] -> [2, 2, Co, 2, 2, Ci]: the sub-pixel kernels, summed in fp32, rounded to bf16 once."""
    taps = _SUBPIXEL_TAPS.to(w.device)
    sub = torch.einsum("akr,cls,oirs->acoikl", taps, taps, w.float())
    return sub.permute(0, 1, 2, 4, 5, 3).contiguous().to(torch.bfloat16)


def prepare(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One state-dict tensor in the layout the ops take (see the module table)."""
    if name.endswith(".gamma"):
        return (tensor.float().flatten() * tensor.shape[0] ** 0.5).contiguous()
    if name.endswith(".bias"):
        return tensor.float().contiguous()
    if name.endswith(".resample.1.weight"):  # an upsampler's 3x3 conv (Wan2.2 `upsampler.`, Wan2.1 `upsamplers.0.`)
        return subpixel_weights(tensor)
    w = tensor if tensor.dim() == 5 else tensor.reshape(*tensor.shape[:2], 1, 1, 1)
    w = w.permute(0, 2, 3, 4, 1).contiguous()
    return w.float() if name == "post_quant_conv.weight" else w.to(torch.bfloat16)


CPU_CHANNELS_FIRST_MIN = 512


def to_compute_layout(prepared: torch.Tensor) -> torch.Tensor:
    """A prepared tensor as the CPU conv computes with it (see the module docstring): where the CPU computes in fp32,
    bf16 -> fp32 holding the same values and wide 3x3 conv weights re-laid channels first; else as prepared."""
    if prepared.dtype != torch.bfloat16 or ops.compute_dtype(prepared.device) == torch.bfloat16:
        return prepared
    wide = min(prepared.shape[0], prepared.shape[-1]) >= CPU_CHANNELS_FIRST_MIN
    if prepared.dim() == 5 and prepared.shape[2] == 3 and wide:
        return prepared.permute(0, 4, 1, 2, 3).float().contiguous().permute(0, 2, 3, 4, 1)
    return prepared.float()


def state_dict_of(vae_or_state_dict) -> dict[str, torch.Tensor]:
    """A state dict from diffusers' `AutoencoderKLWan` (any module with `state_dict()`) or a dict as is."""
    if isinstance(vae_or_state_dict, dict):
        return vae_or_state_dict
    if callable(getattr(vae_or_state_dict, "state_dict", None)):
        return vae_or_state_dict.state_dict()
    raise ValueError("expected an AutoencoderKLWan (or any module with state_dict()) or a state dict; "
                     f"got {type(vae_or_state_dict).__name__}")


def _checked(sd: dict[str, torch.Tensor]) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """The config and the decoder's tensors of `sd`, in execution order: every tensor present, with its shape
    (`infer_config` names any missing or misshapen one), finite."""
    config = infer_config(sd)
    tensors = {name: sd[name].detach() for name in weight_names(config)}
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"state_dict[{name!r}] has non-finite values")
    return config, tensors


def checked(vae_or_state_dict) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """The architecture and the decoder's weights, validated (ValueError naming the first problem)."""
    return _checked(state_dict_of(vae_or_state_dict))


def load(vae_or_state_dict, device: torch.device,
         cpu_compute_layout: bool = True) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """Validate the weights (or take `checked`'s result) and prepare them on `device` (on a CPU in its compute
    layout, `to_compute_layout`, and the convs' weights prepacked, `ops.prepack`, unless the op table takes them as
    prepared: `Ops.cpu_compute_layout`)."""
    config, tensors = vae_or_state_dict if isinstance(vae_or_state_dict, tuple) else checked(vae_or_state_dict)
    # The prepared tensors outlive this call, and the ops' caches of them (prepack, Winograd transforms, the compiled
    # upsample's bias) follow their version counters, which tensors made under torch.inference_mode lack: they are
    # made outside it, whatever mode the decoder is built in.
    with torch.inference_mode(False), torch.no_grad(), own_arithmetic(device):
        prepared = {name: _outside_inference_mode(prepare(name, t.to(device))) for name, t in tensors.items()}
        if device.type == "cpu" and cpu_compute_layout:
            prepared = {name: to_compute_layout(t) for name, t in prepared.items()}
            for name, t in prepared.items():
                if t.dim() >= 5 and name != "post_quant_conv.weight":  # the convs the ops run
                    ops.prepack(t)
        return config, prepared


def _outside_inference_mode(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it is an inference tensor (a prepared tensor that is the VAE's own, loaded under
    torch.inference_mode)."""
    return t.clone() if t.is_inference() else t


def decoder_weights(state_dict) -> list[torch.Tensor]:
    """The prepared tensors, in `weight_names(infer_config(state_dict))` order, on the state dict's device."""
    _, tensors = _checked(state_dict_of(state_dict))
    with own_arithmetic(next(iter(tensors.values())).device):
        return [prepare(name, t) for name, t in tensors.items()]
