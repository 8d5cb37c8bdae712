"""PAN2's pipeline stages in FastVideo (docs/design/pan2.md, "PAN2's sampler"); `reference.py` defines their results.

- `PAN2InputStage`: FastVideo's input validation and seeding; the first frame read as PAN2 reads it (the stored
  pixels, no EXIF transpose; cover-resize and centre crop to the requested canvas: `fastvideo_pan2_ext.media.image`).
- `PAN2TextEncodingStage`: Qwen3.5 through PAN2's chat template (system message, generation prompt), the tokens after
  the user header (at most 1536), `hidden_states[-3]`, no padding; the negative prompt alike when guidance is on.
- `PAN2LatentPreparationStage`: the noise FastVideo draws for a seed, in fp32 (PAN2's latents stay fp32).
- `PAN2ConditionStage`: the 49 condition channels: zeros (text-to-video) or the first frame's VAE mode, normalised,
  in latent frame 0 with mask 1 (image-to-video).
- `PAN2DenoisingStage`: flow-match Euler on the scheduler's shifted `linspace(1, 0, N + 1)[:-1]`, timesteps sigma x
  1000, classifier-free guidance `neg + g (pos - neg)` when g > 1, fp32 latents, FastVideo's trajectory convention.
- `PAN2DecodingStage`: FastVideo's decoding stage (whose VAE decodes through the fast decoder when
  `vae_decode_kernel` is on), the streamed save (`streamed_save`) and the latents kept when the decode fails
  (`kept_latents`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from PIL import Image

from fastvideo_pan2_ext.media.image import ImageInputError, check_size, first_frame_from_image, load_image
from fastvideo_pan2_ext.model.architecture import LATENT_CHANNELS

from . import cancel, compat, decode_failure, fast_decode, kept_latents, streamed_save

logger = logging.getLogger(__name__)

SYSTEM_MESSAGE = "You are a helpful assistant. Generate the video with the following instructions."
USER_HEADER = "<|im_start|>user\n"  # the conditioning starts after it: the system message is context, not condition
MAX_PROMPT_TOKENS = 1536
HIDDEN_LAYER = -3  # hidden_states[-3]: the output of the third-last decoder layer, before the final norm


class PAN2InputStage(compat.symbol("InputValidationStage")):
    """FastVideo's input checks and seeding, with PAN2's first-frame reading (the frame fills the requested canvas)."""

    def forward(self, batch, fastvideo_args):
        image_path, pil_image = batch.image_path, batch.pil_image
        check_size(batch.height, batch.width)
        if image_path is not None:
            img = load_image(image_path)
        elif pil_image is None or isinstance(pil_image, Image.Image):
            img = pil_image.convert("RGB") if pil_image is not None else None
        else:
            raise ImageInputError(f"pil_image must be a PIL.Image.Image; got {type(pil_image).__name__}")
        frame = None if img is None else first_frame_from_image(img, batch.height, batch.width)

        # FastVideo's checks and seeding, without its own image reading (which applies EXIF orientation).
        batch.image_path, batch.pil_image = None, None
        batch = super().forward(batch, fastvideo_args)
        batch.image_path = image_path
        batch.pil_image = None if frame is None else frame.to(self.device)
        return batch


def prompt_embeds(prompt: str, tokenizer, text_encoder, device) -> torch.Tensor:
    """PAN2's conditioning for one prompt: [1, L, D], L <= MAX_PROMPT_TOKENS (reference: `pan2_prompt_embeds`)."""
    messages = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": prompt or " "}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    header = tokenizer(USER_HEADER, add_special_tokens=False)["input_ids"]
    start = _find(ids[0].tolist(), header)
    if start is None:
        raise ValueError(f"the tokenizer's chat template does not contain the user header {USER_HEADER!r}: PAN2's "
                         f"prompt encoding crops after it")
    ids = ids[:, :start + MAX_PROMPT_TOKENS].to(device)
    hidden = text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[HIDDEN_LAYER]
    return hidden[:, start:]


def _find(ids: list[int], sub: list[int]) -> int | None:
    """The index just after the first occurrence of `sub` in `ids`."""
    for i in range(len(ids) - len(sub) + 1):
        if ids[i:i + len(sub)] == sub:
            return i + len(sub)
    return None


class PAN2TextEncodingStage(compat.symbol("PipelineStage")):
    """Qwen3.5 as PAN2's sampler calls it, for the prompt and (with guidance) the negative prompt.

    As FastVideo's own text stage: an encoder parked off this rank's device (`text_encoder_cpu_offload` loads it on
    the CPU) is moved onto the device for the prompts and back afterwards, so it holds no GPU memory while the DiT
    works; the embeddings are on this rank's device either way."""

    def __init__(self, text_encoder, tokenizer) -> None:
        super().__init__()
        self.text_encoder, self.tokenizer = text_encoder, tokenizer

    @torch.no_grad()
    def forward(self, batch, fastvideo_args):
        if not isinstance(batch.prompt, str):
            raise ValueError(f"PAN2 takes one prompt string per request; got {type(batch.prompt).__name__}")
        from torch.distributed.tensor import DTensor

        first, device = next(self.text_encoder.parameters()), compat.executor.local_torch_device()
        parked = first.device
        # FastVideo's rule: an FSDP-wrapped encoder (DTensor weights) moves its own layers; a plain one is moved.
        moved = parked.type != torch.device(device).type and not isinstance(first, DTensor)
        if moved:
            self.text_encoder.to(device)
        try:
            batch.prompt_embeds = [self._embeds(batch.prompt, fastvideo_args)]
            if batch.do_classifier_free_guidance:
                negative = batch.negative_prompt if isinstance(batch.negative_prompt, str) else ""
                batch.negative_prompt_embeds = [self._embeds(negative, fastvideo_args)]
        finally:
            if moved:
                self.text_encoder.to(parked)
        return batch

    def _embeds(self, prompt: str, fastvideo_args) -> torch.Tensor:
        """One prompt's embeddings on this rank's device in the DiT's dtype (the encoder where it computes now)."""
        embeds = prompt_embeds(prompt, self.tokenizer, self.text_encoder, next(self.text_encoder.parameters()).device)
        return embeds.to(compat.executor.local_torch_device(), _dtype(fastvideo_args.pipeline_config.dit_precision))


class PAN2LatentPreparationStage(compat.symbol("PipelineStage")):
    """The initial noise, [B, 48, T', H/16, W/16] in fp32, drawn as FastVideo draws it (CPU generators per seed)."""

    def forward(self, batch, fastvideo_args):
        arch = fastvideo_args.pipeline_config.vae_config.arch_config
        shape = (batch.num_videos_per_prompt, LATENT_CHANNELS,
                 (batch.num_frames - 1) // arch.temporal_compression_ratio + 1,
                 batch.height // arch.spatial_compression_ratio, batch.width // arch.spatial_compression_ratio)
        if batch.latents is None:
            batch.latents = compat.symbol("randn_tensor")(shape, generator=batch.generator,
                                                          device=compat.executor.local_torch_device(),
                                                          dtype=torch.float32)
        batch.raw_latent_shape = shape
        return batch


class PAN2ConditionStage(compat.symbol("PipelineStage")):
    """The condition the DiT reads beside the noisy latents: 48 latent channels and a mask, [B, 49, T', h, w]."""

    def __init__(self, vae) -> None:
        super().__init__()
        self.vae = vae

    @torch.no_grad()
    def forward(self, batch, fastvideo_args):
        b, _, t, h, w = batch.latents.shape
        condition = torch.zeros(b, LATENT_CHANNELS + 1, t, h, w, device=batch.latents.device)
        if batch.pil_image is not None:  # the first frame from PAN2InputStage
            device = compat.executor.local_torch_device()
            self.vae = self.vae.to(device)  # FastVideo's stages move the VAE in and out the same way
            vae_dtype = _dtype(fastvideo_args.pipeline_config.vae_precision)
            mode = self.vae.encode(batch.pil_image.to(device, vae_dtype)).mode().float().to(condition.device)
            if fastvideo_args.vae_cpu_offload:
                self.vae.to("cpu")
            cfg = self.vae.config
            mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=mode.device).view(1, -1, 1, 1, 1)
            std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=mode.device).view(1, -1, 1, 1, 1)
            condition[:, :LATENT_CHANNELS, :1] = (mode - mean) / std
            condition[:, LATENT_CHANNELS, :1] = 1.0
        batch.image_latent = condition
        return batch


class PAN2DenoisingStage(compat.symbol("PipelineStage")):
    """PAN2's sampler loop (reference: `pan2_sample`)."""

    def __init__(self, transformer, scheduler) -> None:
        super().__init__()
        self.transformer, self.scheduler = transformer, scheduler

    @torch.no_grad()
    def forward(self, batch, fastvideo_args):
        steps = batch.num_inference_steps
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=batch.latents.device)
        dit_dtype = _dtype(fastvideo_args.pipeline_config.dit_precision)
        latents = batch.latents.float()
        condition = batch.image_latent.to(dit_dtype)
        guidance = batch.guidance_scale
        trajectory = []
        for i, t in enumerate(self.scheduler.timesteps):
            cancel.check(batch, i, steps)  # a served job deleted while it runs stops here (JobCancelled)
            model_input = torch.cat([latents.to(dit_dtype), condition], dim=1)
            timestep = t.expand(latents.shape[0]).to(latents.device)
            velocity = self._velocity(model_input, batch.prompt_embeds[0], timestep, i, batch)
            if batch.do_classifier_free_guidance and guidance > 1:
                negative = self._velocity(model_input, batch.negative_prompt_embeds[0], timestep, i, batch)
                velocity = negative + guidance * (velocity - negative)  # in the DiT's dtype, as vLLM-Omni does
            latents = self.scheduler.step(velocity.float(), t, latents, return_dict=False)[0].float()
            if batch.return_trajectory_latents:
                trajectory.append(latents)
        if trajectory:
            batch.trajectory_latents = torch.stack(trajectory, dim=1).cpu()
            batch.trajectory_timesteps = self.scheduler.timesteps.cpu()
        batch.latents = latents
        manager = getattr(self.transformer, "_layerwise_offload_manager", None)
        if fastvideo_args.dit_layerwise_offload and getattr(manager, "enabled", False):
            manager.release_all()
        return batch

    def _velocity(self, model_input, text, timestep, step, batch):
        with compat.symbol("set_forward_context")(current_timestep=step, attn_metadata=None, forward_batch=batch):
            return self.transformer(hidden_states=model_input, encoder_hidden_states=text.to(model_input.dtype),
                                    timestep=timestep)


def _dtype(precision: str) -> torch.dtype:
    return compat.symbol("PRECISION_TO_TYPE")[precision]


class PAN2DecodingStage(compat.symbol("DecodingStage")):
    """FastVideo's decoding stage (whose VAE decodes through the fast decoder when it is switched on), the streamed
    save, and the latents kept when the decode fails."""

    def forward(self, batch, fastvideo_args):
        fastvideo_args.pipeline_config.check_vae_options()  # again: FastVideo may set fields after construction
        request = compat.executor.batch_extra(batch, streamed_save.KEY, streamed_save.StreamedSaveRequest)
        keeping = compat.executor.batch_extra(batch, decode_failure.REQUEST_KEY, decode_failure.KeepLatentsRequest)
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
        latents = batch.latents.to(compat.executor.local_torch_device())
        return compat.pipelines.denormalize_latents(self, latents, fastvideo_args)

    def _stream(self, batch, request, fastvideo_args):
        latents = self._vae_input(batch, fastvideo_args)
        streamed_save.write_while_decoding(self.vae, latents, request)
        _, _, _, height, width = fast_decode.decoder_for(self.vae, latents.device).output_shape(latents)
        batch.output = streamed_save.empty_output(latents.shape[0], height, width)
        return batch
