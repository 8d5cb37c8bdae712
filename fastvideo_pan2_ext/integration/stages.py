"""PAN2's two pipeline stages that differ from FastVideo's Wan TI2V pipeline: reading the first frame, and decoding.

- `PAN2InputStage`: FastVideo's `InputValidationStage` reads the image with EXIF transpose and sizes the first frame
  for a fixed 480*832 area. PAN2 reads the stored pixels and sizes the frame for the requested height x width
  (`fastvideo_pan2_ext.image`, bit-identical to the reference); everything else the stage does is FastVideo's.
- `PAN2DecodingStage`: FastVideo's decoding stage, which decodes through the fast decoder when PAN2's
  `vae_decode_kernel` (the Wan VAE config's `decode_kernel`) is on (`fast_decode`). A batch carrying a
  `StreamedSaveRequest` (`streamed_save`) is written to its mp4 as it is decoded, by rank 0, instead of returned. A
  batch carrying a `KeepLatentsRequest` (`decode_failure`: every PAN2 request with the fast decoder on) keeps its
  latents beside its video when the decode (or the streamed write) fails (`kept_latents`).
"""

from __future__ import annotations

import logging

from PIL import Image

from fastvideo_pan2_ext.image import ImageInputError, check_size, first_frame_from_image, load_image

from . import adapter, decode_failure, fast_decode, kept_latents, streamed_save

logger = logging.getLogger(__name__)


class PAN2InputStage(adapter.symbol("InputValidationStage")):
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


class PAN2DecodingStage(adapter.symbol("DecodingStage")):
    """FastVideo's decoding stage (whose VAE decodes through the fast decoder when it is switched on), the streamed
    save, and the latents kept when the decode fails."""

    def forward(self, batch, fastvideo_args):
        fastvideo_args.pipeline_config.check_vae_options()  # again: FastVideo may set fields after construction
        request = adapter.batch_extra(batch, streamed_save.KEY, streamed_save.StreamedSaveRequest)
        keeping = adapter.batch_extra(batch, decode_failure.REQUEST_KEY, decode_failure.KeepLatentsRequest)
        if request is not None and fast_decode.options(self.vae.config) is None:
            raise ValueError("a streamed save needs the fast decoder (the parent asked for one without it)")
        try:
            if request is None:
                return super().forward(batch, fastvideo_args)
            return self._stream(batch, request, fastvideo_args)
        except Exception as exc:  # after denoising: keep the latents (an interrupt is no Exception: nothing kept)
            if keeping is None:
                raise
            latents = self._vae_input(batch, fastvideo_args)  # as the failed decode had them
            return kept_latents.keep(self, batch, latents, keeping, fastvideo_args, exc)

    def _vae_input(self, batch, fastvideo_args):
        """The latents as FastVideo's decode hands them to the VAE: on this rank's device, de-normalized."""
        return adapter.denormalize_latents(self, batch.latents.to(adapter.local_torch_device()), fastvideo_args)

    def _stream(self, batch, request, fastvideo_args):
        latents = self._vae_input(batch, fastvideo_args)
        streamed_save.write_while_decoding(self.vae, latents, request)
        _, _, _, height, width = fast_decode.decoder_for(self.vae, latents.device).output_shape(latents)
        batch.output = streamed_save.empty_output(latents.shape[0], height, width)
        return batch
