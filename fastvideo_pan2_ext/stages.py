"""PAN2's two pipeline stages that differ from FastVideo's Wan TI2V pipeline: reading the first frame, and decoding.

- `PAN2InputStage`: FastVideo's `InputValidationStage` reads the image with EXIF transpose and sizes the first frame
  for a fixed 480*832 area. PAN2 reads the stored pixels and sizes the frame for the requested height x width
  (`fastvideo_pan2_ext.image`, bit-identical to the reference); everything else the stage does is FastVideo's.
- `PAN2DecodingStage`: with `vae_decode_kernel` the latents are de-normalized exactly as FastVideo does, then decoded
  by `fastvideo_pan2_ext.vae_kernel.WanVAEDecoder` on this rank; without it FastVideo's decode runs unchanged.
"""

from __future__ import annotations

import logging

import torch
from fastvideo.distributed.parallel_state import get_local_torch_device
from fastvideo.pipelines.stages import DecodingStage, InputValidationStage
from PIL import Image

from fastvideo_pan2_ext.image import ImageInputError, check_size, first_frame_from_image, load_image

logger = logging.getLogger(__name__)


class PAN2InputStage(InputValidationStage):
    """FastVideo's input validation, with PAN2's first-frame reading."""

    def forward(self, batch, fastvideo_args):
        image_path, pil_image = batch.image_path, batch.pil_image
        check_size(batch.height, batch.width)
        if image_path is None and pil_image is None:
            return super().forward(batch, fastvideo_args)
        if image_path is not None:
            img = load_image(image_path)
        elif isinstance(pil_image, Image.Image):
            img = pil_image.convert("RGB")
        else:
            raise ImageInputError(f"pil_image must be a PIL.Image.Image; got {type(pil_image).__name__}")
        frame = first_frame_from_image(img, batch.height, batch.width)

        # FastVideo's checks and seeding, without its own image reading.
        batch.image_path, batch.pil_image = None, None
        batch = super().forward(batch, fastvideo_args)
        batch.image_path = image_path
        batch.pil_image = frame.to(self.device)  # what the denoising stage hands to the VAE encoder
        batch.height, batch.width = frame.shape[-2], frame.shape[-1]
        return batch


class PAN2DecodingStage(DecodingStage):
    """FastVideo's decoding stage; `vae_decode_kernel=True` routes the VAE decode through WanVAEDecoder."""

    def __init__(self, vae, pipeline=None) -> None:
        super().__init__(vae, pipeline)
        self._kernel_decoder = None
        self._kernel_decoder_key = None

    def _decoder(self, device: torch.device, frames_per_pass: int):
        key = (id(self.vae), str(device), frames_per_pass)
        if self._kernel_decoder is None or self._kernel_decoder_key != key:
            from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

            self._kernel_decoder = WanVAEDecoder(self.vae, device=device, local=True, frames_per_pass=frames_per_pass)
            self._kernel_decoder_key = key
            logger.info("PAN2 decode: WanVAEDecoder (backend %s, frames_per_pass %d) on %s",
                        self._kernel_decoder.backend, frames_per_pass, device)
        return self._kernel_decoder

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, fastvideo_args) -> torch.Tensor:
        config = fastvideo_args.pipeline_config
        if not getattr(config, "vae_decode_kernel", False):
            return super().decode(latents, fastvideo_args)
        device = get_local_torch_device()
        latents = self._denormalize_latents(latents.to(device), fastvideo_args)
        video = self._decoder(device, config.vae_frames_per_pass).decode(latents)
        return (video.float() / 2 + 0.5).clamp(0, 1)
