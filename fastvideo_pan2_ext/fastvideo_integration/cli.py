"""``fastvideo generate --pipeline NAME``: choose a plugin pipeline and its defaults from the stock CLI.

FastVideo 0.2.1's ``generate`` takes ``--config RUN_CONFIG`` plus dotted overrides (``--generator.*``,
``--request.*``). `install()` extends it (through `compat.cli.extend_generate_cli`) so that:

- ``--pipeline`` appears in ``fastvideo generate --help``;
- without ``--pipeline`` everything is FastVideo's, unchanged;
- ``--pipeline pan2`` makes ``--config`` optional, builds the run config from it (if given) and the dotted overrides
  exactly as FastVideo does, then selects `PAN2Pipeline` + `PAN2PipelineConfig`, fills PAN2's sampling defaults the
  user did not set, and checks the inputs (checkpoint folder, image, size) before any model loads;
- an unknown name, or bad input, ends the command with one ``fastvideo generate: error: ...`` line (exit code 2),
  before any model loads: the checkpoint, the image (present, non-empty, decodable, not a bomb), the size, the
  frame count (4k + 1), the fast decoder's and encoder's options (a misspelt `vae_decode_*` / `vae_encode_*` name,
  a value, `backend cuda` without a GPU, a `max_memory` the request's decode or encode cannot fit), FASTVIDEO_FA4,
  and the output folder (a real write probe);
- a run that is interrupted (Ctrl-C, SIGTERM) or loses a worker stops the workers, leaves no video (not even a
  partial one) and ends with one line and exit code 128 + the signal (130 for Ctrl-C), without a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import multiprocessing
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from fastvideo_pan2_ext.attention import apply_fa4_policy
from fastvideo_pan2_ext.configs.pan2 import (PAN2_FIELDS, PAN2_PRESET, PIPELINE_CLASS_NAME, PAN2PipelineConfig,
                                             check_frame_count, check_videos_per_request)
from fastvideo_pan2_ext.media.image import check_size, cover_size, load_image
from fastvideo_pan2_ext.model import memory
from fastvideo_pan2_ext.vae_kernel.errors import first_line
from fastvideo_pan2_ext.media.video_io import check_writable

from . import compat, decode_failure, fast_decode, fast_encode, memory_check, streamed_save
from .checkpoint import check_pan2_checkpoint


def select_pan2(generator: dict) -> None:
    """Make a raw config's `generator` section run PAN2 (in place), as ``--pipeline pan2`` does for ``generate`` and
    ``serve``: the checkpoint checked, `PAN2Pipeline` selected, PAN2's config object built from its fields."""
    model_path = generator.get("model_path")
    if not model_path:
        raise ValueError("--pipeline pan2 needs a checkpoint: --generator.model_path PATH")
    check_pan2_checkpoint(model_path)
    pipeline = generator.setdefault("pipeline", {})
    pipeline.setdefault("components", {})["override_pipeline_cls_name"] = PIPELINE_CLASS_NAME
    # PAN2's config object replaces FastVideo's choice; a pipeline-config JSON the user gave is loaded onto it, and
    # PAN2's own fields given as dotted overrides go through its constructor (which validates them).
    experimental = pipeline.setdefault("experimental", {})
    json_path = experimental.pop("pipeline_config", None) or pipeline["components"].pop("pipeline_config_path", None)
    if json_path is not None and not isinstance(json_path, str):
        raise ValueError(f"--pipeline pan2: pipeline_config must be a JSON file path; got {json_path!r}")
    check_vae_option_names(experimental)
    pan2_config = PAN2PipelineConfig(**{k: experimental.pop(k) for k in PAN2_FIELDS if k in experimental})
    if json_path:
        pan2_config.load_from_json(json_path)
        pan2_config.check_vae_options()
    experimental["pipeline_config"] = pan2_config


def check_vae_option_names(experimental: dict) -> None:
    """ValueError naming the nearest valid name for a `vae_encode_*` / `vae_decode_*` key that is no option (FastVideo
    passes unknown keys on and drops them: a misspelt switch would silently leave the fast path off)."""
    valid = {*PAN2_FIELDS, *(f.name for f in dataclasses.fields(PAN2PipelineConfig))}
    for name in experimental:
        if name.startswith(("vae_encode", "vae_decode")) and name not in valid:
            options = sorted(n for n in valid if n.startswith("vae_"))
            nearest = difflib.get_close_matches(name, options, n=1)
            hint = f"did you mean {nearest[0]}?" if nearest else f"the options are {', '.join(options)}"
            raise ValueError(f"unknown PAN2 option {name}: {hint}")


def _pan2_run_config(args):
    raw = compat.cli.raw_generate_config(args.config, compat.cli.generate_cli_overrides(args))
    select_pan2(raw["generator"])

    request = raw["request"]
    sampling = request.setdefault("sampling", {})
    for key, value in PAN2_PRESET.defaults.items():
        sampling.setdefault(key, value)
    check_size(sampling["height"], sampling["width"])
    chosen = memory_check.choose_layout(raw["generator"], memory.Request(sampling["height"], sampling["width"],
                                                                         sampling["num_frames"]))
    if chosen is not None:
        print(f"fastvideo generate: PAN2 on this machine's GPUs: {chosen.describe()}", file=sys.stderr)
    check_videos_per_request(sampling.get("num_videos_per_prompt", 1))
    image_path = request.get("inputs", {}).get("image_path")
    if image_path is not None:  # image-to-video; without one, text-to-video
        img = load_image(image_path)  # reads it fully: a missing, unreadable, truncated or oversized image fails here
        cover_size(img.width, img.height, sampling["height"], sampling["width"])

    config = compat.cli.validated_generate_config(raw)
    check_frame_count(config.request.sampling.num_frames)
    sampling = config.request.sampling
    # The fast decoder's and encoder's options where they will run (a GPU, a budget), before the workers load models.
    pan2_config, vae = raw["generator"]["pipeline"]["experimental"]["pipeline_config"], \
        fast_decode.meta_vae(config.generator.model_path)
    fast_decode.check_runs_here(pan2_config.vae_config, vae, (1, 3, sampling.num_frames, sampling.height,
                                                              sampling.width), prefix="vae_")
    fast_encode.check_runs_here(pan2_config, vae if image_path is not None else None,  # text-to-video encodes none
                                (1, 3, 1, sampling.height, sampling.width), prefix="vae_")
    memory_check.check(compat.symbol("generator_config_to_fastvideo_args")(config.generator),
                       memory.Request(sampling.height, sampling.width, sampling.num_frames))
    output_path = config.request.output.output_path  # a file (.mp4) or a folder FastVideo names the file in
    check_writable(output_path if output_path.endswith(".mp4") else Path(output_path) / "video.mp4")
    apply_fa4_policy()  # in the parent, so the workers it spawns inherit the decision
    return config


PIPELINES: dict[str, Callable] = {"pan2": _pan2_run_config}


def fail(command: str, error: str | BaseException) -> NoReturn:
    """`fastvideo <command>: error: <the message, or the error's first line>` and exit code 2, before any model
    loads (argparse's convention for a bad invocation)."""
    if isinstance(error, BaseException):
        error = first_line(error)
    print(f"fastvideo {command}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def _add_arguments(parser) -> None:
    parser.add_argument("--pipeline", type=str, default=None, metavar="NAME",
                        help=f"Plugin pipeline to run, with its defaults ({', '.join(sorted(PIPELINES))}); "
                        "--config is then optional.")
    parser.usage = "fastvideo generate [--pipeline NAME] [--config RUN_CONFIG] [--dotted.override VALUE]"


def _validate(args, fastvideo_validate) -> None:
    name = getattr(args, "pipeline", None)
    if name is None:
        return fastvideo_validate(args)
    if name not in PIPELINES:
        fail("generate", f"unknown --pipeline {name!r}; known pipelines: {', '.join(sorted(PIPELINES))}")
    try:
        compat.cli.hand_run_config_to_generate(args, PIPELINES[name](args))
    except (ValueError, OSError) as exc:
        fail("generate", exc)


_ENDINGS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated",
            signal.SIGQUIT: "a worker failed (its error is above)"}


def _run(args, fastvideo_run) -> None:
    if getattr(args, "pipeline", None) is None:
        return fastvideo_run(args)
    with _ends_cleanly():
        return fastvideo_run(args)


@contextlib.contextmanager
def _ends_cleanly():
    """Ctrl-C, SIGTERM and SIGQUIT (FastVideo's worker sends it to the parent when it fails) end the run here: the
    workers are stopped, no video (not even a partial one) is left, one line is printed, the exit code is
    128 + the signal."""
    received: list[int] = []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def end(message: str, code: int):
        for s in _ENDINGS:  # a second Ctrl-C while stopping must not leave half a cleanup
            signal.signal(s, signal.SIG_IGN)
        stop_workers()
        streamed_save.remove_left_partials()
        print(f"fastvideo generate: {message}; no video written", file=sys.stderr)
        return SystemExit(code)

    previous = {s: signal.signal(s, interrupt) for s in _ENDINGS}
    try:
        yield
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        raise end(_ENDINGS[signum], 128 + signum) from None
    except RuntimeError as exc:
        failed = decode_failure.failure_in(exc)
        if failed is not None:  # the decode failed after denoising; its latents are kept (or it says why not)
            stop_workers()  # idle now: stopped at once, so nothing of theirs prints after the line
            print(f"fastvideo generate: {failed}", file=sys.stderr)
            raise SystemExit(1) from None
        if not isinstance(exc.__cause__, (EOFError, ConnectionError)):  # FastVideo lost the pipe to a worker
            raise
        raise end("a worker process died", 1) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_workers(timeout_s: float = 5.0) -> None:
    """Terminate this process's children (FastVideo's workers: they clean up on SIGTERM), then kill stragglers."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join()


def install() -> None:
    """Extend FastVideo's `generate` command (idempotent)."""
    compat.cli.extend_generate_cli(_add_arguments, _validate, _run)
