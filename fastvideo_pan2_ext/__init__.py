"""PAN2 image-to-video for FastVideo, with a fast Wan2.2 VAE decoder.

Importing this package is cheap (it runs at interpreter start-up through the plugin hook's ``.pth`` file):
FastVideo, torch and the config classes are imported only when one of these names is first used.
"""

__version__ = "0.1.0"

__all__ = ["PAN2PipelineConfig", "PAN2Pipeline", "register", "__version__"]


def register() -> None:
    """The ``fastvideo.plugins`` entry point: teach FastVideo about PAN2 (idempotent; see `registration`)."""
    from fastvideo_pan2_ext.registration import register as _register

    _register()


def __getattr__(name: str):
    if name == "PAN2PipelineConfig":
        from fastvideo_pan2_ext.configs import PAN2PipelineConfig

        return PAN2PipelineConfig
    if name == "PAN2Pipeline":
        from fastvideo_pan2_ext.pipeline import PAN2Pipeline

        return PAN2Pipeline
    raise AttributeError(f"module 'fastvideo_pan2_ext' has no attribute {name!r}")
