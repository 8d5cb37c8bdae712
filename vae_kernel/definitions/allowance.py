"""The correctness allowance of a fast decode (docs/design.md, "Definitions"): one rule, used by the runtime
self-check, the tests, the benchmarks and the GPU check.

Against the fp32 reference decode of the same latents, with d = candidate - reference: every element finite (and, for
a video, in [-1, 1]); max|d| <= ALLOWANCE x the baseline's max|d|; RMS(d) <= ALLOWANCE x the baseline's RMS(d). The
baseline is the same computation done the release way: diffusers' decode in bf16 for a video, the op in bf16 for one
op.
"""

from __future__ import annotations

import dataclasses
import math

import torch

ALLOWANCE = 3.0
VIDEO_PEAK_TO_PEAK = 2.0  # videos live in [-1, 1]


def psnr_db(rms_err: float, peak_to_peak: float = VIDEO_PEAK_TO_PEAK) -> float:
    """PSNR of an error of RMS `rms_err` on a signal spanning `peak_to_peak` (inf for an exact match)."""
    return math.inf if rms_err == 0 else 20 * math.log10(peak_to_peak / rms_err)


@dataclasses.dataclass(frozen=True)
class AllowanceReport:
    """The rule's figures for one comparison, and its verdict (`ok`)."""

    name: str
    max_err: float
    rms_err: float
    baseline_max_err: float
    baseline_rms_err: float
    finite: bool
    in_range: bool

    @property
    def ok(self) -> bool:
        return (self.finite and self.in_range and self.max_err <= ALLOWANCE * self.baseline_max_err
                and self.rms_err <= ALLOWANCE * self.baseline_rms_err)

    @property
    def psnr_db(self) -> float:
        return psnr_db(self.rms_err)

    @property
    def baseline_psnr_db(self) -> float:
        return psnr_db(self.baseline_rms_err)

    def figures(self) -> dict:
        """The report as JSON-able numbers (every result file's audit): the fields, the verdict, PSNRs, and each error
        as a multiple of the baseline's (at most ALLOWANCE where `ok`)."""
        return {**dataclasses.asdict(self), "ok": self.ok, "psnr_db": self.psnr_db,
                "baseline_psnr_db": self.baseline_psnr_db,
                "max_ratio": self.max_err / self.baseline_max_err if self.baseline_max_err else math.inf,
                "rms_ratio": self.rms_err / self.baseline_rms_err if self.baseline_rms_err else math.inf}

    def __str__(self) -> str:
        return (f"{self.name}: max|d| {self.max_err:.3g} (allowed {ALLOWANCE * self.baseline_max_err:.3g}), "
                f"RMS(d) {self.rms_err:.3g} (allowed {ALLOWANCE * self.baseline_rms_err:.3g}), finite={self.finite}, "
                f"in_range={self.in_range} -> {'ok' if self.ok else 'OUTSIDE THE ALLOWANCE'}")


def compare_to_reference(name: str, candidate: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                         unit_range: bool = False) -> AllowanceReport:
    """The allowance rule applied to any tensor: a video (with `unit_range`) or one op's output."""
    if candidate.shape != reference.shape or baseline.shape != reference.shape:
        raise ValueError(f"{name}: shapes differ: candidate {list(candidate.shape)}, reference "
                         f"{list(reference.shape)}, baseline {list(baseline.shape)}")
    ref = reference.double()
    cand = candidate.double()
    finite = bool(torch.isfinite(cand).all())
    d = cand - ref
    db = baseline.double() - ref
    return AllowanceReport(
        name=name,
        max_err=float(d.abs().max()) if finite else math.inf,
        rms_err=float(d.pow(2).mean().sqrt()) if finite else math.inf,
        baseline_max_err=float(db.abs().max()),
        baseline_rms_err=float(db.pow(2).mean().sqrt()),
        finite=finite,
        in_range=(not unit_range) or (finite and bool(cand.abs().max() <= 1.0)),
    )
