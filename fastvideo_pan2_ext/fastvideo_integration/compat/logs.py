"""FastVideo's output (fastvideo.utils, fastvideo.logger): its colour codes only on terminals, never with NO_COLOR."""

from __future__ import annotations

import functools
import os
import sys

from .seams import Seam, replace_once

SEAMS = (
    Seam("fastvideo.utils", "_add_prefix", "a worker prefixes each line of its stdout and stderr with its name in "
         "colour codes, whatever the stream is (a file, a pipe): wrapped so that only a terminal gets them",
         replaced=True, mentions="{CYAN}("),
    Seam("fastvideo.utils", "CYAN", "... read when a stream is prefixed: empty for a stream that gets none",
         replaced=True),
    Seam("fastvideo.utils", "RESET", "... likewise", replaced=True),
    Seam("fastvideo.logger", "_info", "the first logger.info of a distributed process (WORLD_SIZE > 1) warns in "
         "colour codes, read from the module when it logs", mentions="GREEN,"),
    Seam("fastvideo.logger", "GREEN", "... empty where FastVideo's log stream (stdout) gets none", replaced=True),
    Seam("fastvideo.logger", "RESET", "... likewise", replaced=True),
)


def colours(stream) -> bool:
    """Whether ANSI colour codes may be written to `stream` (no-color.org's convention): never with NO_COLOR set (to
    anything but the empty string), else only where the stream is a terminal."""
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # not a file, or a closed one
        return False


def colour_only_on_terminals() -> None:
    """FastVideo writes colour codes whatever its output is (a worker's line prefix, a warning of distributed
    processes), so a log file or a pipe gets raw escape sequences: they follow `colours` instead. Idempotent."""
    import fastvideo.logger as fastvideo_logger
    import fastvideo.utils as fastvideo_utils

    if not colours(sys.stdout):  # where FastVideo's logging writes
        fastvideo_logger.GREEN = fastvideo_logger.RESET = ""

    def make(original):
        @functools.wraps(original)
        def _add_prefix(file, *args, **kwargs):
            codes = fastvideo_utils.CYAN, fastvideo_utils.RESET
            if not colours(file):
                fastvideo_utils.CYAN = fastvideo_utils.RESET = ""
            try:
                return original(file, *args, **kwargs)
            finally:
                fastvideo_utils.CYAN, fastvideo_utils.RESET = codes

        return _add_prefix

    replace_once(fastvideo_utils, "_add_prefix", make)
