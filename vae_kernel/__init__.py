"""The fast Wan2.2 VAE decoder (portable PyTorch path and compiled CUDA path). Importable without FastVideo.

`WanVAEDecoder(vae_or_state_dict, device, pg, frames_per_pass, local, backend, tile_rows, max_memory)
.decode(latents)` / `.decode_iter(latents)` are the entry points (DESIGN.md §3); `peak_bytes(shape, tile_rows)` is a
decode's peak working memory; `weight_names()` / `decoder_weights(state_dict)` give the prepared weights in the
order a compiled kernel consumes them; `ops.Ops` is the op table compiled kernels plug into.
"""

from .decoder import WanVAEDecoder
from .ops import TORCH_OPS, Ops, select_ops
from .weights import WAN22_CONFIG, decoder_weights, weight_names

__all__ = ["WanVAEDecoder", "weight_names", "decoder_weights", "Ops", "TORCH_OPS", "select_ops", "WAN22_CONFIG"]
