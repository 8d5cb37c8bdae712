"""What the parent and the decoding stage tell each other about a failed decode (docs/design/outputs.md, "Kept latents
and the decode command"), imported by both sides (`streamed_save` in the parent, `kept_latents` in the worker):

- `keeps_latents(args)`: the requests whose failed decode keeps its latents;
- `KeepLatentsRequest` (parent -> worker, in `batch.extra[REQUEST_KEY]`): where to keep them, and the video's fps;
- `DecodeFailure` (worker -> parent, in `batch.extra[FAILURE_KEY]`): what failed and where the latents are;
- `DecodeFailed`: the parent's exception, whose message is the one line naming the file and the decode command;
  `failure_in` finds it behind FastVideo's RuntimeError.
"""

from __future__ import annotations

import dataclasses
import os

from fastvideo_pan2_ext.media import latents_file

from . import fast_decode

REQUEST_KEY = "pan2_keep_latents"  # batch.extra key of the parent's KeepLatentsRequest
FAILURE_KEY = "pan2_decode_failed"  # batch.extra key of the worker's DecodeFailure


def keeps_latents(fastvideo_args) -> bool:
    """Whether a failed decode of a PAN2 request keeps its latents: the fast decoder is on, the output is pixels, and
    the workers are local `mp` processes (they share the parent's filesystem, and the parent checks what they
    return before FastVideo reads it)."""
    return (fast_decode.options(fastvideo_args.pipeline_config.vae_config) is not None
            and fastvideo_args.output_type != "latent" and fastvideo_args.distributed_executor_backend == "mp")


@dataclasses.dataclass(frozen=True)
class KeepLatentsRequest:
    """Parent -> decoding stage: if this request's decode fails, keep its latents beside `output` (the video it is
    for, an absolute path) for a video at `fps`."""

    output: str
    fps: float

    @classmethod
    def beside(cls, output, fps: float) -> KeepLatentsRequest:
        return cls(os.path.abspath(output), float(fps))  # the worker's folder need not be the parent's


@dataclasses.dataclass(frozen=True)
class DecodeFailure:
    """Worker -> parent: the decode failed with `error`; its latents are in `latents` (None: keeping them failed too,
    with `keep_error`)."""

    error: str
    latents: str | None
    keep_error: str | None = None

    def line(self) -> str:
        if self.latents is None:
            return (f"the decode failed ({self.error}), and keeping its latents failed too ({self.keep_error}); no "
                    "video written")
        return (f"the decode failed ({self.error}); the latents are kept in {self.latents}; make the video with: "
                f"{latents_file.decode_command(self.latents)}")


class DecodeFailed(RuntimeError):
    """A PAN2 request's decode failed after denoising; the message says where its latents are kept."""

    def __init__(self, failure: DecodeFailure) -> None:
        super().__init__(failure.line())
        self.failure = failure


def failure_in(exc: BaseException | None) -> DecodeFailed | None:
    """The DecodeFailed behind `exc` (FastVideo re-raises errors of its forward thread as a RuntimeError from them)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DecodeFailed):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
