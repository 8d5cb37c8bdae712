"""PAN2's two pipeline stages that differ from FastVideo's Wan TI2V pipeline: reading the first frame, and decoding.

- `PAN2InputStage`: FastVideo's `InputValidationStage` reads the image with EXIF transpose and sizes the first frame
  for a fixed 480*832 area. PAN2 reads the stored pixels and sizes the frame for the requested height x width
  (`fastvideo_pan2_ext.image`, bit-identical to the reference); everything else the stage does is FastVideo's.
- `PAN2DecodingStage`: with `vae_decode_kernel` the latents are de-normalized exactly as FastVideo does, then decoded
  by `fastvideo_pan2_ext.vae_kernel.WanVAEDecoder` on this rank (or, for a request that only saves its video, written
  to the mp4 as they are decoded: `stream_save`); without it FastVideo's decode runs unchanged.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fastvideo.distributed.parallel_state import get_local_torch_device
from fastvideo.pipelines.stages import DecodingStage, InputValidationStage
from PIL import Image

from fastvideo_pan2_ext.image import ImageInputError, check_size, first_frame_from_image, load_image
from fastvideo_pan2_ext.stream_save import STREAM_TO

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
    """FastVideo's decoding stage; `vae_decode_kernel=True` routes the VAE decode through WanVAEDecoder (exact tiles
    with `vae_decode_tile_rows` / `vae_decode_max_memory`), and a batch whose `extra[STREAM_TO]` names an mp4 (set
    by `stream_save` in the parent) is written to that file as it is decoded, by rank 0, instead of being returned."""

    def __init__(self, vae, pipeline=None) -> None:
        super().__init__(vae, pipeline)
        self._kernel_decoder = None
        self._kernel_decoder_key = None
        self._stream_to: tuple[str, float] | None = None  # (mp4 path, fps) for this batch's video decode

    def _decoder(self, device: torch.device, config):
        options = (config.vae_frames_per_pass, config.vae_decode_tile_rows, config.vae_decode_max_memory)
        key = (id(self.vae), str(device), *options)
        if self._kernel_decoder is None or self._kernel_decoder_key != key:
            from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder

            frames_per_pass, tile_rows, max_memory = options
            self._kernel_decoder = WanVAEDecoder(self.vae, device=device, local=True, frames_per_pass=frames_per_pass,
                                                 tile_rows=tile_rows, max_memory=max_memory)
            self._kernel_decoder_key = key
            logger.info("PAN2 decode: WanVAEDecoder (backend %s, frames_per_pass %d, tile_rows %s, max_memory %s) "
                        "on %s", self._kernel_decoder.backend, frames_per_pass, tile_rows, max_memory, device)
        return self._kernel_decoder

    def forward(self, batch, fastvideo_args):
        path = (batch.extra or {}).get(STREAM_TO)
        # Only the batch's video streams; trajectory decodes (which FastVideo runs after it) return frames.
        self._stream_to = None if path is None else (path, batch.fps)
        try:
            return super().forward(batch, fastvideo_args)
        finally:
            self._stream_to = None

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, fastvideo_args) -> torch.Tensor:
        config = fastvideo_args.pipeline_config
        stream_to, self._stream_to = self._stream_to, None
        if hasattr(config, "check_vae_options"):
            config.check_vae_options()  # again: FastVideo may set fields after the config was made
        if not getattr(config, "vae_decode_kernel", False):
            if stream_to is not None:
                raise ValueError("a streamed save needs vae_decode_kernel=True (the parent asked for one without it)")
            return super().decode(latents, fastvideo_args)
        device = get_local_torch_device()
        latents = self._denormalize_latents(latents.to(device), fastvideo_args)
        decoder = self._decoder(device, config)
        if stream_to is not None:
            return self._decode_to_file(decoder, latents, *stream_to)
        video = decoder.decode(latents)
        return (video.float() / 2 + 0.5).clamp(0, 1)

    @staticmethod
    def _decode_to_file(decoder, latents: torch.Tensor, path: str, fps: float) -> torch.Tensor:
        """Write the video to `path` as it is decoded (samples in lockstep, laid out as FastVideo saves a batch);
        returns the video's shape with no frames: they are in the file."""
        from fastvideo_pan2_ext.video_io import write_grid_stream

        batch, _, _, height, width = decoder.output_shape(latents)
        if not dist.is_initialized() or dist.get_rank() == 0:  # one writer; FastVideo returns rank 0's result
            start = time.perf_counter()
            try:
                frames = write_grid_stream([decoder.decode_iter(latents[b:b + 1]) for b in range(batch)], path, fps)
            except BaseException:
                Path(path).unlink(missing_ok=True)  # a cut-off video is a wrong video
                raise
            logger.info("PAN2 decode: wrote %d frames to %s while decoding (%.2f s)", frames, path,
                        time.perf_counter() - start)
        return torch.empty((batch, 3, 0, height, width))
