"""FastVideo's Wan VAE (fastvideo.configs.models.vaes, fastvideo.models.vaes): the fast decoder's and the fast
encoder's switches as fields of its config, its decode and encode routed to them, and the hook after it moves."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from .seams import Seam, replace_once

SEAMS = (
    Seam("fastvideo.configs.models.vaes", "WanVAEConfig", "gets the fast decoder's and the fast encoder's switches "
         "and options as dataclass fields, so every Wan pipeline's config, CLI override and config file can set them",
         replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.decode", "routed to the fast decoder when its config's "
         "decode_kernel is on (FastVideo's decoding stage calls it with de-normalized latents)", replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.encode", "routed to the fast encoder when its config's "
         "encode_kernel is on (every Wan encode: image-to-video's conditioning, TI2V's first frame, video-to-video, "
         "preprocessing); it returns a DiagonalGaussianDistribution of the moments", replaced=True),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan.encode", "... and runs the feature-cache encode (the one "
         "the fast encoder computes) only while the module's use_feature_cache is on",
         mentions="self.use_feature_cache"),
    Seam("fastvideo.models.vaes.common", "DiagonalGaussianDistribution", "the fast encoder's moments are returned in "
         "FastVideo's own distribution class, so .mean, .mode() and .sample(generator) are FastVideo's",
         name="DiagonalGaussianDistribution"),
    Seam("fastvideo.models.vaes.wanvae", "AutoencoderKLWan._apply", "what `.to()` runs (FastVideo's vae_cpu_offload "
         "and its encoding stages move the VAE): the fast decoder and encoder follow it", replaced=True),
)


def add_config_fields(fields: dict[str, tuple[Any, Any]]) -> None:
    """Add dataclass fields (name -> (type, default)) to FastVideo's WanVAEConfig, in place (idempotent): its
    constructor, `dataclasses.fields` (which FastVideo's config-file and CLI routes check) and pickling see them."""
    from fastvideo.configs.models.vaes import WanVAEConfig as cls

    if all(name in cls.__dataclass_fields__ for name in fields):
        return
    annotations = cls.__dict__["__annotations__"]
    for f in dataclasses.fields(cls):  # the class body's own fields, as dataclass() first read them
        if f.name in annotations:
            setattr(cls, f.name, f)
    for name, (annotation, default) in fields.items():
        annotations[name] = annotation
        setattr(cls, name, default)
    for generated in ("__init__", "__repr__", "__eq__"):
        if generated in cls.__dict__:
            delattr(cls, generated)
    p = cls.__dataclass_params__
    dataclasses.dataclass(cls, init=p.init, repr=p.repr, eq=p.eq, order=p.order, unsafe_hash=p.unsafe_hash,
                          frozen=p.frozen)


def route(method: str, switched_on: Callable[[Any], bool], fast: Callable) -> None:
    """FastVideo's `AutoencoderKLWan.<method>(self, x)` ("decode": x the latents, "encode": the video) calls
    `fast(self, x, original)` where `switched_on(self.config)` (`original(self, x)` is FastVideo's own method, for
    what the fast one cannot serve), and runs unchanged elsewhere. Idempotent."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    def make(original):
        @functools.wraps(original)
        def routed(self, x):
            return fast(self, x, original) if switched_on(self.config) else original(self, x)

        return routed

    replace_once(AutoencoderKLWan, method, make)


_move_hooks: list[Callable[[Any], None]] = []


def after_moves(moved: Callable[[Any], None]) -> None:
    """FastVideo's `AutoencoderKLWan._apply` (what `.to()` runs: FastVideo's `vae_cpu_offload` moves the VAE to the
    CPU after each decode, and its encoding stages move it to the GPU before an encode and back after) calls
    `moved(self)` after it (each hook once, in registration order). Idempotent."""
    from fastvideo.models.vaes.wanvae import AutoencoderKLWan

    if moved not in _move_hooks:
        _move_hooks.append(moved)

    def make(original):
        @functools.wraps(original)
        def _apply(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            for hook in _move_hooks:
                hook(self)
            return result

        return _apply

    replace_once(AutoencoderKLWan, "_apply", make)
