"""PAN2 image-to-video for FastVideo, with a fast Wan VAE decoder and encoder.

Rooms (docs/design.md, "Rooms"): `plugin_loader` (FastVideo plugins, generic), `integration` (PAN2 in FastVideo: the
one seam to FastVideo's internals, registration, CLI, pipeline and stages), `demo` (demos and the tiny checkpoint
maker), `configs`, `attention`, `vae_kernel` (the decoder and encoder library, usable without FastVideo), `reference` (the
definition of results), `image` and `video_io`, and `diffusers_decode` / `diffusers_encode` (the fast decoder and
encoder for diffusers' Wan VAE: `enable_fast_decode` / `enable_fast_encode` and their `disable_`s, on the routing
they share, `diffusers_route`).

Importing this package is cheap: FastVideo, torch and the config classes are imported only when one of the names
below is first used.
"""

from fastvideo_pan2_ext.version import __version__

__all__ = ["PAN2PipelineConfig", "PAN2Pipeline", "DecodeFailed", "register", "enable_fast_decode",
           "disable_fast_decode", "is_fast_decode_enabled", "enable_fast_encode", "disable_fast_encode",
           "is_fast_encode_enabled", "WanVAEDecoder", "WanVAEEncoder", "__version__"]


def register() -> None:
    """The ``fastvideo.plugins`` entry point: teach FastVideo about PAN2 (idempotent; `integration.registration`)."""
    from fastvideo_pan2_ext.integration.registration import register as _register

    _register()


def __getattr__(name: str):
    if name == "PAN2PipelineConfig":
        from fastvideo_pan2_ext.configs import PAN2PipelineConfig

        return PAN2PipelineConfig
    if name == "PAN2Pipeline":
        from fastvideo_pan2_ext.integration.pipeline import PAN2Pipeline

        return PAN2Pipeline
    if name == "DecodeFailed":  # what VideoGenerator raises when a PAN2 decode fails (its latents kept)
        from fastvideo_pan2_ext.integration.decode_failure import DecodeFailed

        return DecodeFailed
    if name in ("enable_fast_decode", "disable_fast_decode", "is_fast_decode_enabled"):  # diffusers' Wan VAE
        from fastvideo_pan2_ext import diffusers_decode

        return getattr(diffusers_decode, name)
    if name in ("enable_fast_encode", "disable_fast_encode", "is_fast_encode_enabled"):
        from fastvideo_pan2_ext import diffusers_encode

        return getattr(diffusers_encode, name)
    if name in ("WanVAEDecoder", "WanVAEEncoder"):  # the VAE library; neither FastVideo nor diffusers is imported
        from fastvideo_pan2_ext import vae_kernel

        return getattr(vae_kernel, name)
    raise AttributeError(f"module 'fastvideo_pan2_ext' has no attribute {name!r}")
