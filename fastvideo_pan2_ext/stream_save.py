"""Streamed save: when a PAN2 request only saves its video, the worker writes the mp4 as the fast decoder yields
frames, so the whole video is never held in memory.

FastVideo 0.2.1 saves in the parent process (`VideoGenerator._generate_single_video`), after the worker has decoded
the whole video and handed it over as fp32 [B, 3, F, H, W] (481 frames at 704x1248: 5.1 GB, and once more as the
parent's `* 255` copy). `install()` wraps that method. For a `PAN2PipelineConfig` with `vae_decode_kernel=True`, a
request that saves its video without returning frames (the CLI's case), a pixel output and local workers (the `mp`
executor: same filesystem), it passes the output path to the workers in `batch.extra[STREAM_TO]` and runs the request
with `save_video=False`. `PAN2DecodingStage` on rank 0 then writes the file through `video_io` as it decodes
(byte-identical to FastVideo's save of the same frames, its batch grid layout included), and the result gets
`video_path` and `size` as FastVideo sets them. Every other request runs exactly as FastVideo runs it.

PAN2 requests also get FastVideo 0.2.1's one-video-per-request limit checked here, before any work starts.
"""

from __future__ import annotations

import copy
import functools
import logging

logger = logging.getLogger(__name__)

STREAM_TO = "pan2_stream_to"  # batch.extra key: the mp4 the decoding stage writes as it decodes


def streams(fastvideo_args, sampling_param) -> bool:
    """Whether this request's video is written by the decoding stage while it decodes."""
    return (getattr(fastvideo_args.pipeline_config, "vae_decode_kernel", False) is True
            and bool(sampling_param.save_video) and not sampling_param.return_frames
            and fastvideo_args.output_type != "latent" and fastvideo_args.distributed_executor_backend == "mp")


def install() -> None:
    """Wrap `VideoGenerator._generate_single_video` (idempotent)."""
    from fastvideo.entrypoints.video_generator import VideoGenerator

    original = VideoGenerator._generate_single_video
    if getattr(original, "_pan2_wrapped", False):
        return

    @functools.wraps(original)
    def _generate_single_video(self, prompt, sampling_param=None, fastvideo_args=None, **kwargs):
        from fastvideo_pan2_ext.configs.pan2 import PAN2PipelineConfig, check_videos_per_request
        from fastvideo_pan2_ext.video_io import mp4_size

        args = fastvideo_args if fastvideo_args is not None else self.fastvideo_args
        if not isinstance(args.pipeline_config, PAN2PipelineConfig) or sampling_param is None:
            return original(self, prompt, sampling_param, fastvideo_args, **kwargs)
        check_videos_per_request(sampling_param.num_videos_per_prompt)
        if not streams(args, sampling_param):
            return original(self, prompt, sampling_param, fastvideo_args, **kwargs)
        path = kwargs["output_path"]
        sampling_param = copy.copy(sampling_param)
        sampling_param.save_video = False  # the decoding stage saves; FastVideo must not save an empty output
        kwargs["_extra_overrides"] = {**kwargs.get("_extra_overrides", {}), STREAM_TO: path}
        result = original(self, prompt, sampling_param, fastvideo_args, **kwargs)
        result["video_path"] = path
        result["size"] = mp4_size(path)
        logger.info("Saved video to %s (written by the decoding stage while it decoded)", path)
        return result

    _generate_single_video._pan2_wrapped = True
    VideoGenerator._generate_single_video = _generate_single_video
