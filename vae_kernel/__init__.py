"""The fast Wan VAE decoder (portable PyTorch path and compiled CUDA path) and encoder. Importable without FastVideo.

`WanVAEDecoder(vae_or_state_dict, device, pg, frames_per_pass, local, backend, tile_rows, max_memory)
.decode(latents)` / `.decode_iter(latents)` and `WanVAEEncoder(vae_or_state_dict, device, **options).encode(video)`
are the entry points (docs/design.md, "Public API"); `weight_names()` /
`decoder_weights(state_dict)` give the prepared weights in the order a compiled kernel consumes them; `ops.Ops` is
the op table compiled kernels plug into. The names below are imported on first use, so that the small modules of this
package (`architecture`, `precision`, `allowance`) can be imported on their own, by the reference decoder too.
"""

import importlib

_EXPORTS = {
    "WanVAEDecoder": "decoder",
    "WanVAEEncoder": "encoder",
    "Ops": "portable.ops",
    "TORCH_OPS": "portable.ops",
    "select_ops": "backends",
    "WAN22_CONFIG": "definitions.architecture",
    "WanVAEConfig": "definitions.architecture",
    "weight_names": "portable.weights",
    "decoder_weights": "portable.weights",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
