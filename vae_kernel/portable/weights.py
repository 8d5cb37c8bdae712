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

import contextlib
import dataclasses
import functools
import weakref
from typing import Callable

import torch

from ..definitions.architecture import (WAN22_CONFIG, WanVAEConfig, expected_encoder_shapes, expected_shapes,
                                        infer_config, infer_encoder_config)
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


def conv_weight_5d(tensor: torch.Tensor) -> torch.Tensor:
    """A conv weight as [Co, Ci, kt, kh, kw] (a view): a 2-D conv's [Co, Ci, kh, kw], a 1x1's [Co, Ci(, 1, 1)] with
    kt = 1."""
    return tensor if tensor.dim() == 5 else tensor.reshape(*tensor.shape[:2], 1, *(tensor.shape[2:] or (1, 1)))


def _channels_last(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A conv weight as a new [Co, kt, kh, kw, Ci] tensor in `dtype` (the layout the ops take)."""
    return conv_weight_5d(tensor).permute(0, 2, 3, 4, 1).to(dtype, memory_format=torch.contiguous_format, copy=True)


def decoder_conv_dtype(name: str) -> torch.dtype | None:
    """The dtype `prepare` gives the decoder's tensor `name` by laying its conv weight out channels last
    (`_channels_last`); None for a tensor it transforms otherwise."""
    if name.endswith((".gamma", ".bias", ".resample.1.weight")):
        return None
    return torch.float32 if name == "post_quant_conv.weight" else torch.bfloat16


def prepare(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One state-dict tensor in the layout the ops take (see the module table): always a new tensor, never `tensor`
    or a view of it (a weight the VAE's owner edits later must not change under the decoder: `PreparedWeights`)."""
    if name.endswith(".gamma"):
        return (tensor.float().flatten() * tensor.shape[0] ** 0.5).contiguous()
    if name.endswith(".bias"):
        return tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if name.endswith(".resample.1.weight"):  # an upsampler's 3x3 conv (Wan2.2 `upsampler.`, Wan2.1 `upsamplers.0.`)
        return subpixel_weights(tensor)
    return _channels_last(tensor, decoder_conv_dtype(name))


def encoder_conv_dtype(name: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype `prepare_encoder` gives the encoder's tensor `name` by laying its conv weight out channels last:
    `dtype`, the activations' (None for the gammas and biases)."""
    return None if name.endswith((".gamma", ".bias")) else dtype


def prepare_encoder(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One encoder tensor in the layout the ops take: gammas and biases as `prepare` makes them; every conv weight
    (3-D, the downsamples' 2-D 3x3 and the attention's 1x1) as [Co, kt, kh, kw, Ci] in `dtype`, the activations'
    (fp32 for the encoder's fp32 precision, bf16 for its bf16 one). Always a new tensor."""
    conv_dtype = encoder_conv_dtype(name, dtype)
    return prepare(name, tensor) if conv_dtype is None else _channels_last(tensor, conv_dtype)


@dataclasses.dataclass(frozen=True)
class WeightPart:
    """Which half of a Wan VAE a set of prepared weights serves, and how its tensors are read and prepared."""

    role: str  # "decoder" or "encoder", in messages
    prefixes: tuple[str, ...]  # the submodules whose weights it reads
    anchor: str  # a layer whose weight tells where the module is
    infer: Callable[[dict], object]  # state dict -> architecture (ValueError naming a bad tensor)
    names: Callable[[object], list[str]]  # architecture -> every tensor it reads, in execution order
    prepare: Callable[[str, torch.Tensor], torch.Tensor]
    # name -> the dtype `prepare` casts that conv weight to, laying it out channels last; None: another transform
    conv_dtype: Callable[[str], torch.dtype | None]


DECODER = WeightPart("decoder", ("decoder.", "post_quant_conv"), "post_quant_conv", infer_config,
                     lambda c: weight_names(c), prepare, decoder_conv_dtype)


def encoder_part(dtype: torch.dtype) -> WeightPart:
    """The encoder's weights, prepared in `dtype` (`prepare_encoder`)."""
    return WeightPart("encoder", ("encoder.", "quant_conv"), "quant_conv", infer_encoder_config,
                      lambda c: list(expected_encoder_shapes(c)), functools.partial(prepare_encoder, dtype=dtype),
                      functools.partial(encoder_conv_dtype, dtype=dtype))


CPU_CHANNELS_FIRST_MIN = 512


def to_compute_layout(prepared: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A prepared tensor as the CPU conv computes with it (see the module docstring): where the CPU computes in fp32
    (bf16 weights on a CPU without AMX-BF16; the encoder's fp32 weights on any), fp32 holding the same values and
    wide 3x3 conv weights re-laid channels first; else as prepared. `device`: the CPU it is for (default: the
    tensor's; a meta tensor stands for one there, `meta_prepared`)."""
    if prepared.dtype not in (torch.bfloat16, torch.float32) or (
            prepared.dtype == torch.bfloat16 and ops.compute_dtype(device or prepared.device) == torch.bfloat16):
        return prepared
    wide = min(prepared.shape[0], prepared.shape[-1]) >= CPU_CHANNELS_FIRST_MIN
    if prepared.dim() == 5 and prepared.shape[2] == 3 and wide:
        return prepared.permute(0, 4, 1, 2, 3).float().contiguous().permute(0, 2, 3, 4, 1)
    return prepared.float()


def state_dict_of(vae_or_state_dict, part: WeightPart = DECODER) -> dict[str, torch.Tensor]:
    """A state dict from diffusers' `AutoencoderKLWan` (any module with `state_dict()`: `module_state_dict`) or a
    dict as is."""
    if isinstance(vae_or_state_dict, dict):
        return vae_or_state_dict
    if isinstance(vae_or_state_dict, torch.nn.Module):
        return module_state_dict(vae_or_state_dict, part)
    if callable(getattr(vae_or_state_dict, "state_dict", None)):
        return vae_or_state_dict.state_dict()
    raise ValueError("expected an AutoencoderKLWan (or any module with state_dict()) or a state dict; "
                     f"got {type(vae_or_state_dict).__name__}")


def module_state_dict(module: torch.nn.Module, part: WeightPart = DECODER) -> dict[str, torch.Tensor]:
    """The weights `module` decodes (encodes) with, under their plain names: a layer wrapped by PEFT's LoRA
    (`x.base_layer`, `x.lora_A`, ...) reads as its base layer, whose weights hold the adapters once they are merged
    (PEFT's `merge`, diffusers' `fuse_lora`); a layer of `part` whose adapters are active but not merged is a
    ValueError (its weights are not what it computes with)."""
    for name, layer in module.named_modules():
        if hasattr(layer, "base_layer") and hasattr(layer, "merged") and name.startswith(part.prefixes):
            if bool(layer.merged) == bool(getattr(layer, "disable_adapters", False)):
                state = "merged but disabled" if layer.merged else "active but not merged"
                raise ValueError(f"{name} has LoRA adapters that are {state} (PEFT): the fast {part.role} reads a "
                                 "layer's weights, so merge its active adapters into them (merge_adapter(), "
                                 "fuse_lora()) or unload them")
    return {key.replace(".base_layer.", "."): tensor for key, tensor in module.state_dict().items()
            if not any(part.startswith("lora_") for part in key.split("."))}


def _checked(sd: dict[str, torch.Tensor], part: WeightPart = DECODER) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """The config and the tensors of `sd` that `part` reads, in execution order: every tensor present, with its shape
    (`part.infer` names any missing or misshapen one), finite."""
    config, tensors = _named(sd, part)
    for name, tensor in tensors.items():
        _check_values(name, tensor)
    return config, tensors


def _named(sd: dict[str, torch.Tensor], part: WeightPart = DECODER) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    config = part.infer(sd)
    return config, {name: sd[name].detach() for name in part.names(config)}


class WeightValuesError(ValueError):
    """A weight whose values cannot be taken: not loaded (on the meta device), of a dtype not prepared from (float8:
    no arithmetic on it here), or not finite."""


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the weights' dtypes prepared from


def _check_values(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise WeightValuesError(f"state_dict[{name!r}] is on the meta device: its values are not loaded (a module "
                                "offloaded layer by layer, e.g. by accelerate's sequential CPU offload)")
    if tensor.dtype not in WEIGHT_DTYPES:
        raise WeightValuesError(f"state_dict[{name!r}] is {tensor.dtype}; the weights must be float32, bfloat16, "
                                "float16 or float64")
    if not torch.isfinite(tensor).all():
        raise WeightValuesError(f"state_dict[{name!r}] has non-finite values")


def architecture(vae_or_state_dict, part: WeightPart = DECODER):
    """The architecture of the weights `part` reads, from their names and shapes alone (ValueError naming a missing
    or misshapen tensor, or unmerged LoRA adapters); their values are checked where they are prepared."""
    return part.infer(state_dict_of(vae_or_state_dict, part))


def checked(vae_or_state_dict, part: WeightPart = DECODER) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """The architecture and the weights `part` reads, validated (ValueError naming the first problem)."""
    return _checked(state_dict_of(vae_or_state_dict, part), part)


def _prepared_on(name: str, tensor: torch.Tensor, device: torch.device, cpu_compute_layout: bool,
                 part: WeightPart = DECODER) -> torch.Tensor:
    """`part.prepare` on `device`, and on a CPU in its compute layout (`to_compute_layout`) unless the op table takes
    the weights as prepared. Call inside `own_arithmetic(device)`."""
    prepared = part.prepare(name, tensor.to(device))
    return to_compute_layout(prepared) if device.type == "cpu" and cpu_compute_layout else prepared


def _prepack(name: str, prepared: torch.Tensor, device: torch.device, cpu_compute_layout: bool) -> None:
    if device.type == "cpu" and cpu_compute_layout and prepared.dim() >= 5 and name != "post_quant_conv.weight":
        ops.prepack(prepared)  # the convs the ops run


@contextlib.contextmanager
def _preparing(device: torch.device):
    """Where prepared tensors are made. They outlive the call, and the ops' caches of them (prepack, Winograd
    transforms, the compiled upsample's bias) follow their version counters, which tensors made under
    torch.inference_mode lack: they are made outside it, whatever mode the decoder is built or called in."""
    with torch.inference_mode(False), torch.no_grad(), own_arithmetic(device):
        yield


def load(vae_or_state_dict, device: torch.device, cpu_compute_layout: bool = True,
         part: WeightPart = DECODER) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """Validate the weights (or take `checked`'s result) and prepare them on `device` (on a CPU in its compute
    layout, `to_compute_layout`, and the convs' weights prepacked, `ops.prepack`, unless the op table takes them as
    prepared: `Ops.cpu_compute_layout`)."""
    config, tensors = vae_or_state_dict if isinstance(vae_or_state_dict, tuple) else \
        checked(vae_or_state_dict, part)
    with _preparing(device):
        prepared = {name: _prepared_on(name, t, device, cpu_compute_layout, part) for name, t in tensors.items()}
        for name, t in prepared.items():
            _prepack(name, t, device, cpu_compute_layout)
        return config, prepared


def meta_prepared(vae: torch.nn.Module, device: torch.device, cpu_compute_layout: bool = True,
                  part: WeightPart = DECODER) -> tuple[WanVAEConfig, dict[str, torch.Tensor]]:
    """What `load` would prepare on `device` from `vae`'s weights, as meta tensors (shapes, dtypes and layouts: all a
    memory plan reads), from a VAE built on the meta device from its config alone: a command line plans with them
    before any weights load."""
    config, tensors = _named(state_dict_of(vae, part), part)
    prepared = {}
    for name, tensor in tensors.items():
        held = part.prepare(name, tensor.to("meta"))
        prepared[name] = to_compute_layout(held, device) if device.type == "cpu" and cpu_compute_layout else held
    return config, prepared


def _prepares_to(part: WeightPart, name: str, source: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether preparing `source` gives `held`, told without preparing it where that is a pure re-layout: a conv
    weight the part lays out channels last without changing its dtype, held on its device in that dtype (the compute
    layout changes no value then: `to_compute_layout`), is compared with `held` seen in the source's order (preparing
    it again would cost a copy of it); False where this cannot tell (the caller prepares and compares)."""
    if part.conv_dtype(name) != source.dtype or held.dtype != source.dtype or held.device != source.device:
        return False
    return torch.equal(conv_weight_5d(source), held.permute(0, 4, 1, 2, 3))


class PreparedWeights:
    """The decoder's (or the encoder's: `part`) prepared weights (`tensors`: name -> prepared tensor, in execution
    order) and where they come from (docs/design/worker.md, "What a weight change costs").

    Made from a module (diffusers' or FastVideo's `AutoencoderKLWan`, held by a weak reference), they follow it:
    `sync` prepares each of the module's current weights again (or, where that is a re-layout, reads it in place:
    `_prepares_to`) and compares it with the one held, so every change is seen, whatever made it: `load_state_dict`,
    `.to()`, a swapped submodule, an in-place op, a write through `.data` (which no version counter records), PEFT's
    merge and unmerge of LoRA adapters, a new architecture. Its cost is preparing the weights once more per check,
    less what it compares in place. `release` drops them from the device (the module left it); the next `sync`
    prepares them again. Made from a state dict, they are its values as given: later edits of the
    dict's tensors are not seen (the prepared tensors are copies, never views of them).

    A prepared tensor is never written after it is made: a changed weight gets a new tensor, so what is derived
    from the old one (`ops.prepack`'s blocked copy, a Winograd transform) never serves the new values.
    """

    def __init__(self, vae_or_state_dict, checked_weights: tuple[WanVAEConfig, dict[str, torch.Tensor]],
                 device: torch.device, cpu_compute_layout: bool, part: WeightPart = DECODER) -> None:
        module = None if isinstance(vae_or_state_dict, dict) else vae_or_state_dict
        self._module = None if module is None else weakref.ref(module)
        self.device, self._cpu_compute_layout, self.part = device, cpu_compute_layout, part
        self.config, self.tensors = load(checked_weights, device, cpu_compute_layout, part)
        self._checksum: float | None = None  # of `tensors`, made when asked; dropped when they change

    def checksum(self) -> float:
        """A checksum of the prepared weights' values (the ranks of a group compare theirs): each tensor's sum,
        weighted by its place, and its sum of magnitudes, in float64; made again after the weights change."""
        if self._checksum is None:
            self._checksum = sum(place * float(t.double().sum()) + float(t.double().abs().sum())
                                 for place, t in enumerate(self.tensors.values(), start=1))
        return self._checksum

    @property
    def follows_module(self) -> bool:
        return self._module is not None

    def module_device(self) -> torch.device | None:
        """Where the module's weights are now (None: made from a state dict, or the module no longer exists)."""
        module = self._module() if self._module is not None else None
        if module is None:
            return None
        # Read from the layer itself (or PEFT's base layer), not a state dict: it runs in `.to()`, after every move.
        layer = getattr(module, self.part.anchor)
        return getattr(layer, "base_layer", layer).weight.device

    def release(self) -> None:
        """Drop the prepared weights (the next `sync` prepares them again from the module)."""
        if not self.follows_module:
            raise ValueError("this decoder was made from a state dict: its prepared weights are the only copy it has, "
                             "so they cannot be released")
        self.tensors.clear()
        self._checksum = None

    def sync(self) -> bool:
        """Bring the prepared weights in step with the module's current ones (ValueError naming a weight the decoder
        cannot take, as at construction); True when any changed. A module that no longer exists changes nothing."""
        module = self._module() if self._module is not None else None
        if module is None:
            if not self.tensors:
                raise ValueError("the decoder's weights were released and the module they came from no longer exists")
            return False
        config, sources = _named(state_dict_of(module, self.part), self.part)
        if config != self.config:
            self.config = config
            self.tensors.clear()
        changed = False
        with _preparing(self.device):
            for name, source in sources.items():
                if source.device.type == "meta":
                    _check_values(name, source)  # raises: nothing to prepare from
                held = self.tensors.get(name)
                if held is not None and _prepares_to(self.part, name, source, held):
                    continue
                fresh = _prepared_on(name, source, self.device, self._cpu_compute_layout, self.part)
                if held is not None and torch.equal(fresh, held):
                    continue
                _check_values(name, source)
                _prepack(name, fresh, self.device, self._cpu_compute_layout)
                self.tensors[name] = fresh  # a new tensor (the old one, and what was derived from it, die with it)
                changed = True  # (a replaced name keeps its place; after a clear they come back in execution order)
        if changed:
            self._checksum = None
        return changed


DecoderWeights = PreparedWeights  # its name from before the encoder shared it


def decoder_weights(state_dict) -> list[torch.Tensor]:
    """The prepared tensors, in `weight_names(infer_config(state_dict))` order, on the state dict's device."""
    _, tensors = _checked(state_dict_of(state_dict))
    with _preparing(next(iter(tensors.values())).device):
        return [prepare(name, t) for name, t in tensors.items()]
