"""The allowance for a fast decode (`vae_kernel.definitions.allowance`, docs/design.md "Definitions") as a test
assertion, and a cache of the oracle decodes it is measured against: the fp32 reference and the release bf16 decode
(diffusers' `AutoencoderKLWan.to(bf16).decode(z.bf16())`).
"""

from __future__ import annotations

import copy
import functools

import torch

from fastvideo_pan2_ext import reference
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference


def check_allowance(video: torch.Tensor, ref32: torch.Tensor, release: torch.Tensor) -> dict:
    """Assert the allowance rule for a video; return its figures (for messages and reports)."""
    report = compare_to_reference("video", video, ref32, release, unit_range=True)
    assert report.ok, str(report)
    assert report.baseline_rms_err > 0, "the release decode equals the fp32 reference: the rule would be vacuous"
    return report.figures()


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
