"""The README's "Try it" blocks run as written: the checkpoint maker, the CLI example and the Python API example, in a
folder laid out like the repository root (its `.venv` and package folder linked), each block's text unchanged."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from _pan2_helpers import OFFLINE, video_frames_and_size

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def readme_blocks() -> dict[str, str]:
    """The code blocks marked `<!-- readme-test: NAME -->` in README.md, by name."""
    text = (REPO / "README.md").read_text()
    return {name: code for name, code in re.findall(r"<!-- readme-test: (\w+) -->\n```\w+\n(.*?)```", text, re.S)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder standing in for the repository root, with the tiny checkpoint made by the README's own block."""
    root = tmp_path_factory.mktemp("readme")
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / "fastvideo_pan2_ext").symlink_to(REPO / "fastvideo_pan2_ext")
    _bash(readme_blocks()["checkpoint"], root)
    return root


def _bash(code: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **OFFLINE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_readme_has_the_three_blocks():
    assert set(readme_blocks()) == {"checkpoint", "cli", "python", "diffusers_checkpoint", "diffusers"}
    assert 'if __name__ == "__main__":' in readme_blocks()["python"]


def test_readme_checkpoint_block_makes_a_pan2_checkpoint(root):
    from fastvideo_pan2_ext.fastvideo_integration.checkpoint import check_pan2_checkpoint

    check_pan2_checkpoint(root / "out" / "pan2-tiny")


def test_readme_cli_block_writes_the_video(root):
    _bash(readme_blocks()["cli"], root)
    assert video_frames_and_size(root / "out" / "fox.mp4") == (9, (384, 256))


def test_readme_python_block_writes_the_video(root):
    (root / "example.py").write_text(readme_blocks()["python"])
    done = _bash(".venv/bin/python example.py", root)
    assert "out/fox-api.mp4 (256, 384, 9)" in done.stdout
    assert video_frames_and_size(root / "out" / "fox-api.mp4") == (9, (384, 256))
