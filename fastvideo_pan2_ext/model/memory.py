"""PAN2's memory plan: what one GPU holds for a request, by component, before any weight loads (docs/design/pan2.md,
"PAN2's memory plan").

The bytes come from the checkpoint's own description: the transformer's from its config (`architecture`), the text
encoder's and the VAE's from their safetensors headers (parameter counts, no tensor read), the VAE decode's working
memory from the fast decoder's planner (`vae_kernel.planning`), and one joint block's activations at the request's
token count by arithmetic (below). FastVideo's options change what is resident (`Layout`): sequence parallelism
splits the video tokens, FSDP the transformer's weights, layer-wise offload keeps two joint blocks of it on the GPU,
the text encoder's CPU offload keeps it on the GPU only while it encodes, the VAE's keeps it off the GPU while the DiT
works.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

from fastvideo_pan2_ext.model.architecture import PAN2TransformerConfig, weight_shapes

GiB = 2 ** 30
HEADROOM = 0.95  # of a GPU's memory a plan may use: the allocator's fragmentation and CUDA's own context take the rest
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
VAE_TEMPORAL, VAE_SPATIAL = 4, 16  # the Wan2.2 VAE's compression


@dataclass(frozen=True)
class Request:
    height: int
    width: int
    num_frames: int
    text_tokens: int = 1536 + 8  # the most PAN2 conditions on (the prompt's cut plus the template's tail)
    label: str | None = None  # what the request stands for in messages, where not a video size

    def describe(self) -> str:
        return self.label or f"{self.width}x{self.height}, {self.num_frames} frames"


@dataclass(frozen=True)
class Layout:
    """FastVideo's options that change what a GPU holds (their FastVideoArgs names)."""

    num_gpus: int = 1
    sp_size: int = 1
    use_fsdp_inference: bool = False
    dit_layerwise_offload: bool = False
    text_encoder_cpu_offload: bool = False
    vae_cpu_offload: bool = False
    dit_precision: str = "bf16"
    text_encoder_precision: str = "bf16"
    vae_precision: str = "fp32"

    def describe(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default and f.name not in ("num_gpus", )]
        return ", ".join(changed) or "no offload"


@dataclass(frozen=True)
class Sizes:
    """The checkpoint's sizes: its transformer config, the text encoder's and the VAE's parameter counts, the text
    encoder's hidden width and layer count."""

    transformer: PAN2TransformerConfig
    text_params: int
    text_hidden: int
    text_layers: int
    vae_params: int

    @classmethod
    def from_checkpoint(cls, folder) -> Sizes:
        folder = os.fspath(folder)
        with open(os.path.join(folder, "transformer", "config.json"), encoding="utf-8") as f:
            transformer = PAN2TransformerConfig.from_json(json.load(f))
        with open(os.path.join(folder, "text_encoder", "config.json"), encoding="utf-8") as f:
            text = json.load(f)
        text = text.get("text_config", text)
        return cls(transformer, _header_params(os.path.join(folder, "text_encoder")), int(text["hidden_size"]),
                   int(text["num_hidden_layers"]), _header_params(os.path.join(folder, "vae")))


def _header_params(folder: str) -> int:
    """The parameters in a component's safetensors files, from their headers (no tensor is read)."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def video_tokens(sizes: Sizes, request: Request) -> int:
    c = sizes.transformer
    pt, ph, pw = c.patch_size
    frames = (request.num_frames - 1) // VAE_TEMPORAL + 1
    return (frames // pt) * (request.height // VAE_SPATIAL // ph) * (request.width // VAE_SPATIAL // pw)


def block_activation_bytes(c: PAN2TransformerConfig, video_tokens: int, text_tokens: int, sp_size: int,
                           dtype_bytes: int) -> int:
    """The peak of one joint block's forward on one rank: its feed-forward, the widest step. Held at once: the
    stream's input and its modulated norm, the first linear's output and its GELU (mlp_ratio wide each), the second
    linear's output: (3 + 2 mlp_ratio) token rows of the inner width, for this rank's share of the video tokens
    (padded to a multiple of sp_size) and every text token (replicated; its feed-forward is context_mlp_ratio wide).
    Attention is flash-style (O(tokens)); its q, k, v and output (4 rows) stay below the feed-forward's 19."""
    local = -(-video_tokens // sp_size)
    rows = local * (3 + 2 * c.mlp_ratio) + text_tokens * (3 + 2 * c.context_mlp_ratio)
    return int(rows * c.inner_dim * dtype_bytes)


def _transformer_resident(sizes: Sizes, layout: Layout) -> int:
    c, b = sizes.transformer, DTYPE_BYTES[layout.dit_precision]
    shapes = weight_shapes(c)
    total = sum(math.prod(s) for s in shapes.values())
    block = sum(math.prod(s) for name, s in shapes.items() if name.startswith("transformer_blocks.0."))
    if layout.dit_layerwise_offload:  # the rest stays; two joint blocks on the GPU (the one running, the next)
        return (total - c.num_layers * block + 2 * block) * b
    if layout.use_fsdp_inference and layout.num_gpus > 1:  # a shard, plus one block gathered whole
        return (total // layout.num_gpus + block) * b
    return total * b


@functools.lru_cache(maxsize=16)
def _vae_decode_bytes(request: Request) -> int:
    """The fast decoder's working memory for the request, untiled one frame per pass and streamed (what a
    PAN2 save runs), from its planner's replay on the meta device (once per request size: the check runs on every
    request)."""
    import torch

    from fastvideo_pan2_ext.vae_kernel.definitions.architecture import WAN22_CONFIG, expected_shapes
    from fastvideo_pan2_ext.vae_kernel.planning.memory import MemoryPlanner
    from fastvideo_pan2_ext.vae_kernel.portable.weights import prepare

    meta = torch.device("meta")
    weights = {n: prepare(n, torch.empty(s, device=meta, dtype=torch.bfloat16))
               for n, s in expected_shapes(WAN22_CONFIG).items()}
    latents = (1, WAN22_CONFIG.z_dim, (request.num_frames - 1) // VAE_TEMPORAL + 1, request.height // VAE_SPATIAL,
               request.width // VAE_SPATIAL)
    return MemoryPlanner(weights, WAN22_CONFIG, torch.device("cuda")).peak_bytes(latents, 1, None, stream=True)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one GPU holds, by component, and in each phase of a request (text, denoise, decode)."""

    request: Request
    layout: Layout
    components: dict
    phases: dict

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def fits(self, gpu_bytes: int) -> bool:
        return self.peak <= HEADROOM * gpu_bytes

    def summary(self) -> str:
        return ", ".join(f"{name} {value / GiB:.1f} GiB" for name, value in self.components.items() if value)


def plan(sizes: Sizes, request: Request, layout: Layout = Layout()) -> MemoryPlan:
    c = sizes.transformer
    dit_b, text_b = DTYPE_BYTES[layout.dit_precision], DTYPE_BYTES[layout.text_encoder_precision]
    tokens = video_tokens(sizes, request)
    components = {
        "transformer weights": _transformer_resident(sizes, layout),
        "text encoder weights": sizes.text_params * text_b,
        # every layer's hidden state is returned (hidden_states[-3] is taken from them)
        "text encoding": request.text_tokens * sizes.text_hidden * (sizes.text_layers + 4) * text_b,
        "VAE weights": sizes.vae_params * DTYPE_BYTES[layout.vae_precision],
        "one joint block's activations": block_activation_bytes(c, tokens, request.text_tokens, layout.sp_size,
                                                                dit_b),
        "latents": 2 * tokens * c.patch_volume * c.out_channels * 4 * 2,  # fp32 latents and the condition
        "VAE decode": _vae_decode_bytes(request),
    }
    vae_resident = 0 if layout.vae_cpu_offload else components["VAE weights"]
    dit, text = components["transformer weights"], components["text encoder weights"]
    text_resident = 0 if layout.text_encoder_cpu_offload else text  # offloaded: back on the CPU once encoded
    phases = {
        "text": dit + text + components["text encoding"] + vae_resident,
        "denoise": dit + text_resident + vae_resident + components["one joint block's activations"]
        + components["latents"],
        "decode": dit + text_resident + components["VAE weights"] + components["VAE decode"] + components["latents"],
    }
    return MemoryPlan(request, layout, components, phases)


# The layouts to try, fastest first: each step gives up some speed for memory. Sharding the DiT over several GPUs (an
# all-gather per block over their links) comes before the text encoder's offload (its 16 GB over PCIe and back for
# every request), which comes before streaming every joint block over PCIe at every step.
def candidate_layouts(num_gpus: int, base: Layout = Layout()) -> list[Layout]:
    vae, fsdp, text = dict(vae_cpu_offload=True), dict(use_fsdp_inference=True), dict(text_encoder_cpu_offload=True)
    steps = [dict(), vae, *([{**vae, **fsdp}] if num_gpus > 1 else []), {**vae, **text},
             *([{**vae, **fsdp, **text}] if num_gpus > 1 else []), {**vae, **text, "dit_layerwise_offload": True}]
    return [dataclasses.replace(base, num_gpus=num_gpus, sp_size=num_gpus, **step) for step in steps]


def first_fitting(sizes: Sizes, request: Request, gpu_bytes: int, num_gpus: int,
                  base: Layout = Layout()) -> MemoryPlan | None:
    for layout in candidate_layouts(num_gpus, base):
        candidate = plan(sizes, request, layout)
        if candidate.fits(gpu_bytes):
            return candidate
    return None


def check(sizes: Sizes, request: Request, layout: Layout, gpu_bytes: int) -> MemoryPlan:
    """The plan, or a ValueError of one line: what the request needs on each GPU, by component, and the options that
    would make it fit (or that none would)."""
    wanted = plan(sizes, request, layout)
    if wanted.fits(gpu_bytes):
        return wanted
    what = (f"PAN2 ({request.describe()}) with {layout.describe()} needs "
            f"{wanted.peak / GiB:.1f} GiB per GPU ({wanted.summary()}), over {HEADROOM:.0%} of this GPU's "
            f"{gpu_bytes / GiB:.1f} GiB")
    better = first_fitting(sizes, request, gpu_bytes, layout.num_gpus, layout)
    if better is None:
        raise ValueError(f"{what}; no offload option makes it fit: use more GPUs (sp_size) or fewer frames")
    raise ValueError(f"{what}: set {better.layout.describe()} ({better.peak / GiB:.1f} GiB)")
