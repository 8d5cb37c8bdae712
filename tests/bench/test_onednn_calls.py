"""bench/onednn_calls.py reads oneDNN's own log: here a real log of a few convs, before and after its mark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import onednn_calls  # noqa: E402

_CONVS = """
import torch
x = torch.randn(1, 8, 3, 6, 5).contiguous(memory_format=torch.channels_last_3d)
w = torch.randn(8, 8, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)
conv = lambda: torch.mkldnn_convolution(x, w, None, [0, 0, 1], [1, 1, 1], [1, 1, 1], 1)
conv()
print(%r, flush=True)
conv(); conv()
""" % onednn_calls.MARK


@pytest.mark.slow
def test_the_summary_counts_only_the_primitives_after_the_mark():
    run = subprocess.run([sys.executable, "-c", _CONVS], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.count(",exec,cpu,convolution,") == 3  # the log is oneDNN's, one line per conv
    summary = onednn_calls.summarize(run.stdout)
    conv = summary["convolution"]
    assert conv["calls"] == 2 and conv["exec_ms"] > 0
    assert sum(conv["implementations"].values()) == 2 and all(":" in name for name in conv["implementations"])
