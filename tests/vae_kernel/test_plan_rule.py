"""The plan rule in one place: `planning.memory.choose_plan` decides every decode's plan (frames per pass, tiles), a
decode group runs `memory.smallest` of its ranks' plans, and no other module of the package reads the rule's
constants or asks the planner its questions."""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
import torch

from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.definitions.architecture import video_shape
from fastvideo_pan2_ext.vae_kernel.planning import memory
from fastvideo_pan2_ext.vae_kernel.planning.memory import AUTO, DecodePlan, MemoryPlanner, choose_plan, smallest

TALL = (1, 8, 9, 12, 4)  # nine latent frames (every choice possible), 12 rows: two ranks' bands are 6 rows + halos


@pytest.fixture(scope="module")
def planner(wan22_state_dict):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", backend="torch")
    return MemoryPlanner(decoder.weights, decoder.config, torch.device("cpu"))


def _free_memory(monkeypatch, planner, working: float) -> None:
    """Stand in for a GPU's free memory (only a GPU reports it): room for the returned video plus `working` bytes."""
    video = 2 * math.prod(video_shape(planner.config, TALL))
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: video + int(working))


def test_smallest_takes_fewer_frames_per_pass_then_smaller_tiles():
    assert smallest([DecodePlan(4, None), DecodePlan(2, None), DecodePlan(8, None)]) == (2, None)
    assert smallest([DecodePlan(1, None), DecodePlan(1, 3), DecodePlan(2, 1)]) == (1, 3)


def test_explicit_options_are_kept(planner):
    assert choose_plan(planner, TALL, 2, None, False, None) == (2, None)
    assert choose_plan(planner, TALL, 2, 5, False, None) == (2, 5)
    assert choose_plan(planner, TALL, 2, 12, False, None) == (2, None)  # a tile of the whole frame is no tile


def test_a_rank_plans_for_its_band(monkeypatch, planner):
    band = memory.band_shape(TALL, 2)
    assert band == (1, 8, 9, 8, 4)
    assert planner.peak_bytes(band, 8) < planner.peak_bytes(TALL, 8)
    _free_memory(monkeypatch, planner, memory.PEAK_HEADROOM * planner.peak_bytes(band, 8) + 1)
    assert choose_plan(planner, TALL, AUTO, None, False, None, ranks=2) == (8, None)
    alone = choose_plan(planner, TALL, AUTO, None, False, None)
    assert alone.frames_per_pass < 8 and alone.tile_rows is None


def test_when_one_frame_per_pass_overflows_only_a_single_rank_tiles(monkeypatch, planner):
    working = memory.PEAK_HEADROOM * planner.peak_bytes(TALL, 1, 3) + 1
    assert memory.PEAK_HEADROOM * planner.peak_bytes(memory.band_shape(TALL, 2), 1) > working  # a band overflows too
    _free_memory(monkeypatch, planner, working)
    alone = choose_plan(planner, TALL, AUTO, None, False, None)
    assert alone.frames_per_pass == 1 and alone.tile_rows is not None and alone.tile_rows >= 3
    assert choose_plan(planner, TALL, AUTO, None, False, None, ranks=2) == (1, None)  # a group never tiles


RULE_NAMES = {"FRAMES_PER_PASS_CHOICES", "DEFAULT_MEMORY_GOAL", "free_device_bytes", "most_frames_per_pass",
              "largest_tile", "PEAK_HEADROOM"}


def test_only_the_planning_module_reads_the_rule():
    package = Path(__file__).resolve().parents[2] / "fastvideo_pan2_ext"
    users = set()
    for root, _, names in os.walk(package, followlinks=True):
        for path in (Path(root) / name for name in names if name.endswith(".py")):
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
                if name in RULE_NAMES:
                    users.add(path.relative_to(package).as_posix())
    assert users == {"vae_kernel/planning/memory.py"}
