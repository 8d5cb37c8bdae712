"""PAN2 image-to-video for FastVideo, with a fast Wan2.2 VAE decoder."""

__version__ = "0.1.0"
