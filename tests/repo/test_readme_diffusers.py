"""The diffusers blocks of README's "The fast decoder in any Wan pipeline" run as written, in a folder laid out like the
repository root: the tiny Wan2.2 TI2V checkpoint, then the example, which loads it with diffusers' own
WanPipeline.from_pretrained, decodes through the fast decoder in exact tiles (enable_tiling()) and writes the mp4."""

from __future__ import annotations

import pytest
from _pan2_helpers import video_frames_and_size
from test_readme import REPO, _bash, readme_blocks

pytestmark = pytest.mark.slow

# Appended to the example: the fast decoder decoded it, in tiles of diffusers' 256 px = 16 latent rows.
CHECK = """
from fastvideo_pan2_ext.diffusers_integration.fast_decode import is_fast_decode_enabled
assert is_fast_decode_enabled(pipe) and pipe.vae.__dict__["_pan2_fast_decode"].worker.last_plan.tile_rows == 16
"""


def test_readme_diffusers_example_writes_the_video(tmp_path):
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    (tmp_path / "fastvideo_pan2_ext").symlink_to(REPO / "fastvideo_pan2_ext")
    blocks = readme_blocks()
    _bash(blocks["diffusers_checkpoint"], tmp_path)
    (tmp_path / "example.py").write_text(blocks["diffusers"] + CHECK)
    done = _bash(".venv/bin/python example.py", tmp_path)
    assert "(9, 384, 256, 3)" in done.stdout
    assert video_frames_and_size(tmp_path / "out" / "fox-diffusers.mp4") == (9, (256, 384))
