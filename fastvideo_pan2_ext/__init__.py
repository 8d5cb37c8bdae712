"""PAN2 image-to-video for FastVideo, with a fast Wan VAE decoder and encoder.

Rooms (docs/design.md, "Rooms"), each a folder: `fastvideo_integration` (PAN2 and the fast VAE in FastVideo: the one
seam to FastVideo's internals, registration, CLI, server, pipeline and stages), `diffusers_integration` (the fast
decoder and encoder for diffusers' Wan VAE: `enable_fast_decode` / `enable_fast_encode` and their `disable_`s),
`model` (PAN2's transformer and text encoder), `vae_kernel` (the decoder and encoder library, usable without FastVideo
or diffusers), `media` (images, videos, kept latents), `commands` (the decode command), `demo` (demos and the tiny
checkpoint maker), `configs`, `attention` (the FA4 policy), `plugin_loader` (FastVideo plugins, generic), and
`reference` (the definition of results).

Importing this package is cheap: FastVideo, torch and the config classes are imported only when one of the names
below is first used.
"""

from fastvideo_pan2_ext.version import __version__

__all__ = ["PAN2PipelineConfig", "PAN2Pipeline", "DecodeFailed", "register", "enable_fast_decode",
           "disable_fast_decode", "is_fast_decode_enabled", "enable_fast_encode", "disable_fast_encode",
           "is_fast_encode_enabled", "WanVAEDecoder", "WanVAEEncoder", "__version__"]


def register() -> None:
    """The ``fastvideo.plugins`` entry point: teach FastVideo about PAN2 (idempotent; `fastvideo_integration.registration`)."""
    from fastvideo_pan2_ext.fastvideo_integration.registration import register as _register

    _register()


def __getattr__(name: str):
    if name == "PAN2PipelineConfig":
        from fastvideo_pan2_ext.configs import PAN2PipelineConfig

        return PAN2PipelineConfig
    if name == "PAN2Pipeline":
        from fastvideo_pan2_ext.fastvideo_integration.pipeline import PAN2Pipeline

        return PAN2Pipeline
    if name == "DecodeFailed":  # what VideoGenerator raises when a PAN2 decode fails (its latents kept)
        from fastvideo_pan2_ext.fastvideo_integration.decode_failure import DecodeFailed

        return DecodeFailed
    if name in ("enable_fast_decode", "disable_fast_decode", "is_fast_decode_enabled"):  # diffusers' Wan VAE
        from fastvideo_pan2_ext.diffusers_integration import fast_decode as diffusers_decode

        return getattr(diffusers_decode, name)
    if name in ("enable_fast_encode", "disable_fast_encode", "is_fast_encode_enabled"):
        from fastvideo_pan2_ext.diffusers_integration import fast_encode as diffusers_encode

        return getattr(diffusers_encode, name)
    if name in ("WanVAEDecoder", "WanVAEEncoder"):  # the VAE library; neither FastVideo nor diffusers is imported
        from fastvideo_pan2_ext import vae_kernel

        return getattr(vae_kernel, name)
    raise AttributeError(f"module 'fastvideo_pan2_ext' has no attribute {name!r}")
