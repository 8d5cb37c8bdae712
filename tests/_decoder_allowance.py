"""DESIGN.md §4's allowance for a fast decode, and a cache of the oracle decodes it is measured against.

`d = video - fp32 reference`: every element finite and in [-1, 1], max|d| <= 3 x and RMS(d) <= 3 x those of the
release bf16 decode (diffusers' `AutoencoderKLWan.to(bf16).decode(z.bf16())`).
"""

from __future__ import annotations

import copy
import functools

import torch

from fastvideo_pan2_ext import reference

ALLOWANCE = 3.0


def error_stats(video: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = video.float() - ref.float()
    return d.abs().max().item(), d.pow(2).mean().sqrt().item()


def check_allowance(video: torch.Tensor, ref32: torch.Tensor, release: torch.Tensor) -> dict:
    """Assert the §4 rule; return the measured figures (for messages and reports)."""
    assert video.shape == ref32.shape, (video.shape, ref32.shape)
    v = video.float()
    assert torch.isfinite(v).all(), "video has non-finite values"
    assert v.abs().max().item() <= 1.0, f"video leaves [-1, 1]: max |v| = {v.abs().max().item()}"
    max_d, rms_d = error_stats(video, ref32)
    max_r, rms_r = error_stats(release, ref32)
    figures = {"max_d": max_d, "rms_d": rms_d, "release_max_d": max_r, "release_rms_d": rms_r}
    assert max_d <= ALLOWANCE * max_r, f"max|d| {max_d:.4g} > {ALLOWANCE} x release {max_r:.4g}: {figures}"
    assert rms_d <= ALLOWANCE * rms_r, f"RMS(d) {rms_d:.4g} > {ALLOWANCE} x release {rms_r:.4g}: {figures}"
    return figures


class Oracle:
    """fp32 reference and release (diffusers bf16) decodes of one model, computed once per latents."""

    def __init__(self, vae, state_dict) -> None:
        self.state_dict = state_dict
        self.release_vae = copy.deepcopy(vae).to(torch.bfloat16)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def decodes(self, z: torch.Tensor, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._cache:
            with torch.no_grad():
                release = self.release_vae.decode(z.to(torch.bfloat16)).sample
            self._cache[key] = reference.decode(z, self.state_dict, torch.float32), release
        return self._cache[key]


@functools.lru_cache(maxsize=None)
def latents(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator)
