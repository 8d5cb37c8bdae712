"""The PAN2 test server (`bench/serve_load.Server`: `fastvideo serve --config`, the shipped example config pointed at
the tiny checkpoint, loopback only) with the faults the tests can ask for (`_serve_faults`)."""

from __future__ import annotations

import os
from pathlib import Path

from bench import serve_load
from bench.serve_load import EXAMPLE_CONFIG, FASTVIDEO, FRAMES, SIZE, serve_config  # noqa: F401 (the tests' names)

REPO = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).resolve().parent / "_serve_faults"  # a sitecustomize that injects the faults
FAULT_PROMPT = "inject-decode-oom"  # a request whose prompt holds this runs out of memory in the worker's decode
PAUSE_PROMPT = "inject-pause-after-saving"  # ... waits in the server once its video is in place, before its job ends
PAUSED = "PAN2 test: paused after saving"  # ... and says so in the server's output, with the video's path


def Server(config: Path) -> serve_load.Server:
    """A test server: every process of it runs the fault injector."""
    return serve_load.Server(config, env={
        "PAN2_TEST_FAULT_PROMPT": FAULT_PROMPT,
        "PAN2_TEST_PAUSE_PROMPT": PAUSE_PROMPT,
        "PAN2_TEST_PAUSED": PAUSED,
        "TQDM_DELAY": "0",  # a progress bar that is drawn at all is drawn at once
        "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO), os.environ.get("PYTHONPATH", "")])})
