"""The rounds every rank of a decode group joins, so that an error on one rank raises on every rank instead of leaving
the others waiting in a collective (docs/design.md, "Out-of-memory retries": several ranks never hang).

A round is one all_gather of each rank's `Report`: its status, a few numbers, and, from a rank that failed, its error's
first line. The decoder's rounds: the agreement on a decode before any work (`agree`), the settling of each attempt,
and the choice of a retry's plan. A rank whose own step before a round raised, whatever it raised, still joins that
round with its failure (`joined`), then raises its own error; every other rank raises one naming that rank and the line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .bands import FAILED, OK

REJECTED = -1  # a rank's step refused its input (ValueError): the others raise ValueError too
LINE_BYTES = 240  # a failure's first line travels as UTF-8, cut to this many bytes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a latent dtype travels as its index here


@dataclasses.dataclass(frozen=True)
class Report:
    """One rank's part of a round."""

    rank: int
    status: int  # OK, REJECTED, or a decode attempt's status (`bands`: OUT_OF_MEMORY, FAILED)
    values: tuple[float, ...]
    line: str  # the failure's first line ("" when none)


def first_line(exc: BaseException, with_type: bool = True) -> str:
    """What the other ranks learn of an error: the first line of its message, after its type (`with_type`)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return f"{type(exc).__name__}: {lines[0]}" if with_type else lines[0]


def gather(pg, comm_device: torch.device, status: int, values: Sequence[float], line: str = "") -> list[Report]:
    """One round: every rank's report, in group rank order (every rank sends as many values; they travel as float64,
    exact for integers below 2**53)."""
    text = line.encode()[:LINE_BYTES].ljust(LINE_BYTES, b"\0")
    mine = torch.tensor([status, *values, *text], dtype=torch.float64, device=comm_device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine, group=pg)
    reports = []
    for rank, tensor in enumerate(everyone):
        status_value, *numbers = tensor.cpu().tolist()
        text = bytes(int(b) for b in numbers[len(values):]).rstrip(b"\0")
        reports.append(Report(rank, int(status_value), tuple(numbers[:len(values)]), text.decode(errors="replace")))
    return reports


def peer_error(report: Report, stage: str) -> Exception:
    """The error a rank raises for another rank's failure (`report`) at `stage` (e.g. "while decoding")."""
    if report.status == REJECTED:
        return ValueError(f"rank {report.rank} of the decode group rejected its latents: {report.line}")
    return RuntimeError(f"rank {report.rank} of the decode group failed {stage}: {report.line}")


def joined(pg, comm_device: torch.device, step: Callable[[], Sequence[float]], width: int, stage: str,
           rejects: tuple[type[BaseException], ...] = ()) -> list[tuple[float, ...]]:
    """This rank's `step()` (its `width` numbers for the round), then the round, which this rank joins even when its
    step raised: it then raises its own error, and every other rank the `peer_error` of the first rank that failed
    (REJECTED for an error of a `rejects` type, else FAILED). Returns every rank's numbers, in group rank order."""
    try:
        values, own, status = tuple(step()), None, OK
    except BaseException as exc:  # noqa: BLE001 - any error, an interrupt included, is re-raised below
        values, own, status = (0.0,) * width, exc, REJECTED if isinstance(exc, rejects) else FAILED
    reports = gather(pg, comm_device, status, values, "" if own is None else first_line(own, status != REJECTED))
    if own is not None:
        raise own
    failed = [report for report in reports if report.status != OK]
    if failed:
        raise peer_error(failed[0], stage)
    return [report.values for report in reports]


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """One rank's view of a decode: what it asks for."""

    shape: tuple[int, ...]
    dtype_index: int
    frames_per_pass: int  # the option: an int, or 0 for "auto"
    architecture: int  # a fingerprint of the decoder's config
    checksum: float  # sum |latents|: the same latents on every rank
    planned_frames_per_pass: int  # what this rank's plan chose (the group runs `memory.smallest`)

    WIDTH = 10  # numbers in a request

    @classmethod
    def of(cls, latents: torch.Tensor, frames_per_pass: int | str, planned: int, config) -> "DecodeRequest":
        return cls(tuple(latents.shape), _DTYPES.index(latents.dtype),
                   frames_per_pass if isinstance(frames_per_pass, int) else 0, hash(config) % (1 << 50),
                   float(latents.detach().double().abs().sum()), planned)

    def values(self) -> list[float]:
        return [*self.shape, self.dtype_index, self.frames_per_pass, self.architecture, self.checksum,
                self.planned_frames_per_pass]

    @classmethod
    def from_values(cls, v: Sequence[float]) -> "DecodeRequest":
        return cls(tuple(int(x) for x in v[:5]), int(v[5]), int(v[6]), int(v[7]), v[8], int(v[9]))

    def same_decode(self, other: "DecodeRequest") -> bool:
        return (dataclasses.astuple(self)[:-2] == dataclasses.astuple(other)[:-2]
                and math.isclose(self.checksum, other.checksum, rel_tol=1e-9, abs_tol=1e-9))

    def __str__(self) -> str:
        option = self.frames_per_pass or "'auto'"
        return (f"latents {list(self.shape)} {_DTYPES[self.dtype_index]}, frames_per_pass {option} "
                f"(checksum {self.checksum:.6g})")


def supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def agree(pg, comm_device: torch.device, propose: Callable[[], DecodeRequest]) -> list[int]:
    """The agreement before a decode: every rank's request (`propose()`: this rank's; it checks the input and raises
    ValueError when it is bad). A rank whose `propose` raised anything raises it, and every other rank a ValueError
    (bad input) or RuntimeError naming that rank and the error's first line; ranks that disagree raise ValueError on
    every rank. Returns every rank's planned frames per pass, in group rank order (the group runs the smallest plan:
    `planning.memory.smallest`). Every rank decides from the same gathered requests, so all decide alike."""
    values = joined(pg, comm_device, lambda: propose().values(), DecodeRequest.WIDTH, "before decoding",
                    rejects=(ValueError,))
    requests = [DecodeRequest.from_values(v) for v in values]
    for rank, theirs in enumerate(requests[1:], start=1):
        if not theirs.same_decode(requests[0]):
            raise ValueError(f"ranks disagree about the decode: rank {rank} has {theirs}; rank 0 has {requests[0]}; "
                             "every rank must pass the same latents")
    return [request.planned_frames_per_pass for request in requests]
