"""A method of diffusers' Wan VAE routed to this package: what `enable_fast_decode` (`decode` -> `WanVAEDecoder`)
and `enable_fast_encode` (`encode` -> `WanVAEEncoder`) share (docs/design/diffusers-integration.md, "The fast decoder
and encoder in diffusers").

A switch puts two instance attributes on diffusers' `AutoencoderKLWan`: its state (a `Route` subclass, under the
subclass's `attribute`) and the method itself, `functools.partial(call, vae, method)`; while any route is on, a third,
`_apply` (what `.to()`, casts and accelerate's offload hooks run), tells each route that the VAE moved. Removing them
(`disable`) restores diffusers' class methods, bit for bit. Each call (`call`): autograd recording goes to diffusers'
method (one warning), diffusers' offload hook runs as its `apply_forward_hook` would, the route's worker (made from
the VAE on the VAE's device) runs, batch element by element under `enable_slicing()`, and the result is wrapped in
diffusers' return types. A VAE the worker cannot take, one offloaded layer by layer, or one whose layers diffusers'
layerwise casting or a forward hook changes (a fused worker runs no layer's forward), runs diffusers' method (one
warning).
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan
from diffusers.hooks.group_offloading import (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER,
                                              _LAZY_PREFETCH_GROUP_OFFLOADING)
from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

from fastvideo_pan2_ext.vae_kernel.backends import check_gpu_for
from fastvideo_pan2_ext.vae_kernel.fallback import Fallback
from fastvideo_pan2_ext.vae_kernel.portable import passes, weights
from fastvideo_pan2_ext.vae_kernel.portable.ops import Ops

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# diffusers' hooks that only move a layer's weights (group offload), not what it computes: the worker reads the same.
_MOVING_HOOKS = frozenset({_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING})


def wan_vae_of(target) -> AutoencoderKLWan:
    """The diffusers AutoencoderKLWan that `target` is or holds as `.vae` (ValueError otherwise)."""
    vae = target if isinstance(target, AutoencoderKLWan) else getattr(target, "vae", None)
    if not isinstance(vae, AutoencoderKLWan):
        what = type(target).__name__ if vae is None else f"{type(target).__name__} whose .vae is {type(vae).__name__}"
        raise ValueError("target must be a diffusers AutoencoderKLWan or a pipeline whose .vae is one; got " + what)
    return vae


def tile_rows_of(vae: AutoencoderKLWan, encode: bool = False) -> int:
    """diffusers' tile height in latent rows (its `tile_latent_min_height`), at least 1. Its encode tiles the
    patchified video, so there a tile is `tile_sample_min_height` patchified rows (Wan2.2: twice the decode's)."""
    ratio = vae.spatial_compression_ratio // ((vae.config.patch_size or 1) if encode else 1)
    return max(1, vae.tile_sample_min_height // ratio)


class Route:
    """One routed method on one VAE: its options, its worker (made from the VAE on first use, on the VAE's device;
    made again when the VAE is on another device), and the warnings it has given. A subclass says which method it
    routes and how its worker runs."""

    method = ""  # diffusers' method it replaces: "decode" / "encode"
    submodules: tuple[str, ...] = ()  # the VAE's submodules that method computes with
    attribute = ""  # the VAE's instance attribute holding the route
    worker_name = ""  # "decoder" / "encoder", as the warnings name it
    input_name = ""  # "latents" / "video"
    verb = ""  # "decoding" / "encoding"

    def __init__(self, options, pg=None, pipeline=None) -> None:
        self.options, self.pg = options, pg
        # The pipeline it was enabled on (weakly: the pipeline holds the VAE): its progress_bar shows the worker's.
        self.pipeline = weakref.ref(pipeline) if pipeline is not None else lambda: None
        self.worker = None
        # The warnings it has given, and its fallback to diffusers' method (vae_kernel.fallback: one policy).
        self._fallback = Fallback(self.switch, self.verb, f"diffusers' {self.method}", _warn)

    @property
    def switch(self) -> str:
        return f"enable_fast_{self.method}"

    def __deepcopy__(self, memo) -> Route:
        """A copied VAE's: the same options and process group; its worker is made from the copy's weights."""
        return type(self)(self.options, self.pg)

    def __reduce__(self):
        """Pickled (torch.save) as its options: the loaded VAE makes its worker from its own weights, on one rank (a
        process group belongs to the job that made it)."""
        backend = self.options.backend
        if isinstance(backend, Ops):
            raise TypeError(f"cannot pickle a VAE whose fast {self.worker_name} runs a given op table (the "
                            f"{backend.name!r} Ops, functions of this process): enable it with backend 'auto', "
                            "'cuda' or 'torch' to save it")
        return type(self), (self.options, None)

    def warn_once(self, key: str, message: str) -> None:
        self._fallback.warn_once(self, key, message)

    def fallback(self, key: str, why: str) -> None:
        """Diffusers' own method runs: the one fallback policy (`vae_kernel.fallback`)."""
        self._fallback(self, key, why, self.worker)

    def worker_for(self, vae: AutoencoderKLWan):
        """The worker for `vae`, or None (after one warning) when diffusers' method runs: offloaded layer by layer,
        changed by hooks (`hooked_reason`), or outside the architecture (`unsupported_reason`)."""
        if any(p.device.type == "meta" for p in self.parameters(vae)):  # accelerate's sequential offload
            self.fallback("sequential", "this AutoencoderKLWan is offloaded layer by layer "
                                        "(enable_sequential_cpu_offload), so its weights are never on the GPU at once")
            return None
        reason = self.hooked_reason(vae)
        if reason is not None:
            self.fallback("hooked", f"{reason}, which the fast {self.worker_name} (one fused computation from the "
                                    "weights) would not apply")
            return None
        reason = self.unsupported_reason(vae)
        if reason is not None:
            self.fallback("unsupported", f"the fast {self.worker_name} cannot {self.method} this AutoencoderKLWan: "
                                         f"{reason}")
            return None
        if self.worker is None or self.worker.device != vae.device:
            self.worker = self.make(vae)
        return self.worker

    @classmethod
    def hooked_reason(cls, vae: AutoencoderKLWan) -> str | None:
        """Why diffusers' method computes something other than the VAE's weights in their dtype, which is what the
        worker computes (so diffusers' method runs), or None: diffusers' layerwise casting (its hooks cast each
        layer's weights from their storage dtype as it runs), another diffusers hook changing a layer (group offload
        only moves weights), or a torch forward hook (it runs only when a layer's forward does)."""
        for prefix in cls.submodules:
            for name, module in getattr(vae, prefix).named_modules(prefix=f"vae.{prefix}"):
                registry = getattr(module, "_diffusers_hook", None)
                casting = None if registry is None else registry.get_hook(_LAYERWISE_CASTING_HOOK)
                if casting is not None:
                    return (f"this VAE is under diffusers' layerwise casting (enable_layerwise_casting: weights stored "
                            f"in {casting.storage_dtype}, each layer computing in {casting.compute_dtype})")
                other = [] if registry is None else [h for h in registry.hooks if h not in _MOVING_HOOKS]
                if other:
                    return f"{name} has diffusers' {other[0]!r} hook, which changes what that layer computes"
                if module._forward_hooks or module._forward_pre_hooks:
                    return f"{name} has a forward hook (register_forward_hook or register_forward_pre_hook)"
        return None

    @classmethod
    def unsupported_reason(cls, vae: AutoencoderKLWan) -> str | None:
        """Why the worker cannot take this VAE (diffusers' method then runs), in a user's words, or None when it
        can."""
        for prefix in cls.submodules:
            module = getattr(vae, prefix)
            if hasattr(module, "_orig_mod"):  # torch.compile's OptimizedModule
                return f"vae.{prefix} is compiled by torch.compile, which only diffusers' {cls.method} runs"
        dtypes = sorted({str(p.dtype) for p in cls.parameters(vae) if p.dtype not in weights.WEIGHT_DTYPES})
        if dtypes:
            return (f"its {cls.worker_name}'s weights are {', '.join(dtypes)}; it takes float32, bfloat16, float16 "
                    "or float64 weights")
        attention = list(getattr(vae.config, "attn_scales", None) or [])
        if attention:
            return (f"its config has attn_scales {attention} (attention inside the down and up blocks); the Wan VAE "
                    "has attention in its middle blocks only")
        try:
            config = cls.architecture(vae)
        except ValueError as exc:
            return f"it is outside the fast {cls.worker_name}'s architecture ({exc})"
        if config.patch_size != (vae.config.patch_size or 1):
            return (f"its {cls.worker_name}'s weights are for patch size {config.patch_size} (3 x p x p channels) "
                    f"but its config says patch_size {vae.config.patch_size!r}")
        return None

    def check_budget(self, vae: AutoencoderKLWan) -> None:
        """ValueError when the options' `max_memory` cannot serve even the smallest input (checked where the VAE
        already is on the device it runs on; else the call checks it before any work)."""
        worker = self.worker_for(vae)
        if worker is None:
            return
        try:
            worker.plan(self.smallest_input(worker))
        except ValueError as exc:
            raise ValueError(f"max_memory={self.options.max_memory!r} is below what any {self.method} needs: "
                             f"{exc}") from None

    # What a subclass defines ---------------------------------------------------------------------------------------

    @classmethod
    def parameters(cls, vae: AutoencoderKLWan) -> list[torch.nn.Parameter]:
        """The VAE's parameters this method computes with."""
        return [p for name in cls.submodules for p in getattr(vae, name).parameters()]

    @classmethod
    def architecture(cls, vae: AutoencoderKLWan):
        """The worker's architecture read from the VAE's weights (its `.patch_size` among it; ValueError naming what
        it cannot take)."""
        raise NotImplementedError

    def make(self, vae: AutoencoderKLWan):
        """A new worker for `vae`, on the VAE's device, with the options (its `.device`, `.plan(shape)`)."""
        raise NotImplementedError

    def smallest_input(self, worker) -> tuple[int, ...]:
        raise NotImplementedError

    def prepare(self, worker, vae: AutoencoderKLWan, x: torch.Tensor) -> None:
        """Per call, before the worker runs: diffusers' switches the options leave to it (`enable_tiling()`)."""

    def run(self, worker, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output(self, vae: AutoencoderKLWan, result: torch.Tensor, return_dict: bool):
        """diffusers' return value for `result` (the batch's)."""
        raise NotImplementedError

    def vae_moved(self, vae: AutoencoderKLWan) -> None:
        """After `vae._apply` (`.to()`, a cast, an offload hook): the worker's prepared weights leave a device the
        VAE left (`Worker.follow_vae`); the worker stays, and prepares them again when the VAE is back."""
        if self.worker is not None:
            self.worker.follow_vae()


def _warn(message: str) -> None:
    # Attributed to the first caller outside this package (the pipeline's code or the user's).
    warnings.warn(message, skip_file_prefixes=(_PACKAGE_DIR,))


def _autograd_records(x, parameters) -> bool:
    if not torch.is_grad_enabled():
        return False
    return (isinstance(x, torch.Tensor) and x.requires_grad) or any(p.requires_grad for p in parameters)


def _progress_bars_of(pipeline, description: str):
    """The pipeline's own progress bars (diffusers' `progress_bar`, honouring `set_progress_bar_config`), or None."""
    if not callable(getattr(pipeline, "progress_bar", None)):
        return None

    def bar(total: int):
        progress = pipeline.progress_bar(total=total)
        if not getattr(progress, "desc", ""):  # a disabled tqdm has none
            progress.set_description(description, refresh=False)
        return progress

    return bar


def call(vae: AutoencoderKLWan, method: str, x: torch.Tensor, return_dict: bool = True):
    """The VAE's `method` while its route is on (the signature and return types of diffusers')."""
    route: Route = next(r for r in vae.__dict__.values() if isinstance(r, Route) and r.method == method)
    diffusers_method = getattr(type(vae), method)
    if _autograd_records(x, route.parameters(vae)):
        route.warn_once("autograd", f"autograd is recording through this {method} (grad enabled and the "
                                    f"{route.input_name} or the VAE's parameters require grad): {route.verb} with "
                                    f"diffusers' {method} so gradients flow; for the fast {route.worker_name} run it "
                                    "under torch.no_grad() or call vae.requires_grad_(False)")
        return diffusers_method(vae, x, return_dict=return_dict)
    hook = getattr(vae, "_hf_hook", None)  # diffusers' apply_forward_hook: an offloaded VAE moves to its device
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(vae)
    worker = route.worker_for(vae)
    if worker is None:
        return diffusers_method(vae, x, return_dict=return_dict)
    route.prepare(worker, vae, x)
    bars = passes.progress_bars.set(_progress_bars_of(route.pipeline(), f"VAE {method}"))
    try:
        if vae.use_slicing and x.shape[0] > 1:
            result = torch.cat([route.run(worker, one) for one in x.split(1)])
        else:
            result = route.run(worker, x)
    finally:
        passes.progress_bars.reset(bars)
    return route.output(vae, result, return_dict)


def _apply(vae: AutoencoderKLWan, *args, **kwargs):
    """The VAE's `_apply` while a route is on: diffusers', then each route follows the VAE."""
    result = type(vae)._apply(vae, *args, **kwargs)
    for route in [r for r in vae.__dict__.values() if isinstance(r, Route)]:
        route.vae_moved(vae)
    return result


def check_group(options, pg, work: str):
    """`options` (checked), after checking `pg`: None or a process group, and a group of several ranks never tiles
    (its ranks split the rows of each `work`, "decode" or "encode"); a ValueError names the problem."""
    if pg is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("pg was given but torch.distributed is not initialized (call init_process_group first)")
        if not isinstance(pg, dist.ProcessGroup):
            raise ValueError(f"pg must be a torch.distributed process group or None; got {type(pg).__name__}")
        ranks = dist.get_world_size(pg)
        if ranks > 1 and options.tiled:
            raise ValueError(f"tile_rows / max_memory tile a {work} on one rank; with a process group of "
                             f"{ranks} ranks the ranks split the rows instead: pass one or the other")
    return options


def enable(target, route_class: type[Route], options, pg=None) -> None:
    """Route `route_class.method` of `target`'s Wan VAE with the checked `options` (replacing a route of that method
    already there). What can be known now is refused now, not after the denoise: `backend="cuda"` where torch sees no
    GPU, and a `max_memory` below what the smallest input needs where the VAE already is on the device it runs on."""
    vae = wan_vae_of(target)
    check_gpu_for(options.backend)  # at the switch: a VAE on the CPU may run on a GPU later (moved, offloaded)
    route = route_class(options, pg, None if target is vae else target)
    if options.max_memory is not None and (vae.device.type == "cuda" or not torch.cuda.is_available()):
        route.check_budget(vae)  # else the call checks it before any work
    vae.__dict__[route.attribute] = route
    # Partials, not bound methods, so that a copy or a pickled VAE gets them bound to itself (a bound method pickles
    # by its name, which is diffusers' method).
    vae.__dict__[route.method] = functools.partial(call, vae, route.method)
    vae.__dict__["_apply"] = functools.partial(_apply, vae)


def disable(target, route_class: type[Route]) -> None:
    """Restore diffusers' own `route_class.method` on `target`'s Wan VAE (nothing to do when it is not routed)."""
    vae = wan_vae_of(target)
    vae.__dict__.pop(route_class.attribute, None)
    vae.__dict__.pop(route_class.method, None)
    if not any(isinstance(r, Route) for r in vae.__dict__.values()):
        vae.__dict__.pop("_apply", None)


def is_enabled(target, route_class: type[Route]) -> bool:
    return isinstance(wan_vae_of(target).__dict__.get(route_class.attribute), route_class)
