"""The rounds every rank of a decode (or encode) group joins, so that an error on one rank raises on every rank instead
of leaving the others waiting in a collective (docs/design/worker.md, "Several ranks never hang").

A round is one all_gather of each rank's `Report`: its status, a few numbers, and, from a rank that failed, its error's
first line. The rounds of a decode and of an encode: the agreement on the work before any of it (`agree`), the
settling of each attempt (`finish`, `settle`, `failure`), and the choice of a retry's plan (`retry_choice`). A rank
whose own step before a round raised, whatever it raised, still joins that round with its failure (`joined`), then
raises its own error; every other rank raises one naming that rank and the line. `work` ("decode" or "encode") names
the work in the errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import traceback

import torch
import torch.distributed as dist

from ..errors import first_line
from ..planning.memory import Plan, smallest
from ..portable.ops import is_out_of_memory
from .bands import FAILED, OK, OUT_OF_MEMORY, LocalRows, PeerFailed, RankRows

REJECTED = -1  # a rank's step refused its input (ValueError): the others raise ValueError too
LINE_BYTES = 240  # a failure's first line travels as UTF-8, cut to this many bytes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # an input dtype travels as its index here
_INPUT = {"decode": "latents", "encode": "video"}  # what a rank of each kind of group is given


@dataclasses.dataclass(frozen=True)
class Report:
    """One rank's part of a round."""

    rank: int
    status: int  # OK, REJECTED, or a decode attempt's status (`bands`: OUT_OF_MEMORY, FAILED)
    values: tuple[float, ...]
    line: str  # the failure's first line ("" when none)


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


def peer_error(report: Report, stage: str, work: str = "decode") -> Exception:
    """The error a rank raises for another rank's failure (`report`) at `stage` (e.g. "while decoding")."""
    if report.status == REJECTED:
        return ValueError(f"rank {report.rank} of the {work} group rejected its {_INPUT[work]}: {report.line}")
    return RuntimeError(f"rank {report.rank} of the {work} group failed {stage}: {report.line}")


def joined(pg, comm_device: torch.device, step: Callable[[], Sequence[float]], width: int, stage: str,
           rejects: tuple[type[BaseException], ...] = (), work: str = "decode") -> list[tuple[float, ...]]:
    """This rank's `step()` (its `width` numbers for the round), then the round, which this rank joins even when its
    step raised: it then raises its own error, and every other rank the `peer_error` of the first rank that failed
    (REJECTED for an error of a `rejects` type, else FAILED). Returns every rank's numbers, in group rank order."""
    try:
        values, own, status = tuple(step()), None, OK
    except BaseException as exc:  # noqa: BLE001 - any error, an interrupt included, is re-raised below
        values, own, status = (0.0,) * width, exc, REJECTED if isinstance(exc, rejects) else FAILED
    # What the other ranks learn of an error: its first line, after its type unless it rejected the input.
    reports = gather(pg, comm_device, status, values, "" if own is None else first_line(own, status != REJECTED))
    if own is not None:
        raise own
    failed = [report for report in reports if report.status != OK]
    if failed:
        raise peer_error(failed[0], stage, work)
    return [report.values for report in reports]


@dataclasses.dataclass(frozen=True)
class Request:
    """One rank's view of a decode (or an encode): what it asks for."""

    shape: tuple[int, ...]
    dtype_index: int
    frames_per_pass: int  # the option: an int, or 0 for "auto"
    architecture: int  # a fingerprint of the decoder's (encoder's) config
    checksum: float  # sum |input|: the same latents (video) on every rank
    weights: float  # the prepared weights' checksum (`weights.PreparedWeights.checksum`): the same VAE on every rank
    planned_frames_per_pass: int  # what this rank's plan chose (the group runs `memory.smallest`)

    WIDTH = 11  # numbers in a request

    @classmethod
    def of(cls, latents: torch.Tensor, frames_per_pass: int | str, planned: int, config,
           weights: float) -> "Request":
        # Summed frame by frame: a video's float64 copy would be 2x its size.
        checksum = sum(float(frame.detach().double().abs().sum()) for frame in latents.unbind(2))
        return cls(tuple(latents.shape), _DTYPES.index(latents.dtype),
                   frames_per_pass if isinstance(frames_per_pass, int) else 0, hash(config) % (1 << 50), checksum,
                   weights, planned)

    def values(self) -> list[float]:
        return [*self.shape, self.dtype_index, self.frames_per_pass, self.architecture, self.checksum, self.weights,
                self.planned_frames_per_pass]

    @classmethod
    def from_values(cls, v: Sequence[float]) -> "Request":
        return cls(tuple(int(x) for x in v[:5]), int(v[5]), int(v[6]), int(v[7]), v[8], v[9], int(v[10]))

    def same_work(self, other: "Request") -> bool:
        """The same input and plan options (the weights aside: `same_weights`)."""
        return (dataclasses.astuple(self)[:-3] == dataclasses.astuple(other)[:-3]
                and math.isclose(self.checksum, other.checksum, rel_tol=1e-9, abs_tol=1e-9))

    def same_weights(self, other: "Request") -> bool:
        # A checksum's float64 sums may round differently on different devices; a weight changed changes it far more.
        return math.isclose(self.weights, other.weights, rel_tol=1e-9, abs_tol=1e-9)

    def __str__(self) -> str:
        option = self.frames_per_pass or "'auto'"
        return (f"input {list(self.shape)} {_DTYPES[self.dtype_index]}, frames_per_pass {option} "
                f"(checksum {self.checksum:.6g})")


DecodeRequest = Request  # its name from before the encoder shared it


def supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def agree(pg, comm_device: torch.device, propose: Callable[[], Request], work: str = "decode") -> list[int]:
    """The agreement before a decode (an encode): every rank's request (`propose()`: this rank's; it checks the input
    and raises ValueError when it is bad). A rank whose `propose` raised anything raises it, and every other rank a
    ValueError (bad input) or RuntimeError naming that rank and the error's first line; ranks that disagree (about
    the input, or hold different weights) raise ValueError on every rank. Returns every rank's planned frames per
    pass, in group rank order (the group runs the smallest plan: `planning.memory.smallest`). Every rank decides from
    the same gathered requests, so all decide alike."""
    values = joined(pg, comm_device, lambda: propose().values(), Request.WIDTH, f"before {work[:-1]}ing",
                    rejects=(ValueError,), work=work)
    requests = [Request.from_values(v) for v in values]
    for rank, theirs in enumerate(requests[1:], start=1):
        if not theirs.same_work(requests[0]):
            raise ValueError(f"ranks disagree about the {work}: rank {rank} has {theirs}; rank 0 has {requests[0]}; "
                             f"every rank must pass the same {_INPUT[work]}")
        if not theirs.same_weights(requests[0]):
            raise ValueError(f"ranks disagree about the {work}'s weights: rank {rank}'s {work}r weights have checksum "
                             f"{theirs.weights:.12g}, rank 0's {requests[0].weights:.12g}; every rank must hold the "
                             "same VAE weights")
    return [request.planned_frames_per_pass for request in requests]


class AttemptFailed(Exception):
    """One attempt of a decode (encode) failed on some rank: `status` (OUT_OF_MEMORY or FAILED), the group ranks
    that failed, this rank's own error if it is one of them, the first failing rank's first line, whether any rank
    had yielded chunks, and what a rank that did not fail raises for a FAILED attempt."""

    def __init__(self, status: int, ranks: list[int], error: BaseException | None, text: str, yielded: bool,
                 peer_error: Exception | None) -> None:
        super().__init__(text)
        self.status, self.ranks, self.error, self.text, self.yielded = status, ranks, error, text, yielded
        self.peer_error = peer_error


def finish(rows: LocalRows, status: int) -> None:
    """The status round after this rank's last exchange, or in place of its next one after a failure (a peer's
    failure heard here is settled next)."""
    if isinstance(rows, RankRows) and rows.active:
        try:
            rows.check_peers(status)
        except PeerFailed:
            pass


def settle(rows: LocalRows, status: int, own: BaseException | None, yielded: bool, line: str = "",
           work: str = "decode") -> None:
    """Every rank's own status of the attempt (OK on a rank that only heard of a failure), the idle ranks' too,
    with the first line of its failure (`own`'s, or `line`): AttemptFailed on every rank when any failed."""
    line = first_line(own, with_type=True) if own is not None else line
    if not isinstance(rows, RankRows):
        if status != OK:
            raise AttemptFailed(status, [0], own if status == FAILED else None, line, yielded, None)
        return
    reports = gather(rows.pg, rows.comm_device, status, [int(yielded)], line)
    worst = max(report.status for report in reports)
    if worst == OK:
        return
    failed = [report for report in reports if report.status == worst]
    raise AttemptFailed(worst, [report.rank for report in failed], own if status == FAILED else None,
                        failed[0].line, any(report.values[0] for report in reports),
                        peer_error(failed[0], f"while {work[:-1]}ing", work))


def failure(error: BaseException, rows: LocalRows, yielded: bool, work: str = "decode") -> AttemptFailed:
    """What a failed attempt means for every rank (after its status round and the group's settling)."""
    if isinstance(error, AttemptFailed):
        return error
    if isinstance(error, PeerFailed):  # heard at an exchange (whose status round it was): this rank is well
        status, error = OK, None
    else:
        status = OUT_OF_MEMORY if is_out_of_memory(error) else FAILED
        if status == OUT_OF_MEMORY:
            traceback.clear_frames(error.__traceback__)  # the attempt's tensors live in those frames
            error = error.with_traceback(None)
        finish(rows, status)
    try:
        settle(rows, status, error, yielded, work=work)
    except AttemptFailed as failed:
        return failed
    raise AssertionError("a failed attempt settled as a success")  # unreachable: a rank reported its failure


def retry_choice(pg, comm_device, propose: Callable[[], Plan | None], work: str = "decode") -> Plan | None:
    """The plan a group retries at after running out of memory: the `smallest` of every rank's `propose()` (its
    plan below the failed one; None when none is smaller), in a round that a rank whose choice fails joins too;
    None when any rank has none. Alone (pg None): `propose()`."""
    if pg is None:
        return propose()

    def proposed() -> list[int]:  # 0: none smaller
        smaller = propose()
        return [0 if smaller is None else smaller.frames_per_pass]

    proposals = [int(p) for p, in joined(pg, comm_device, proposed, 1,
                                         "choosing the plan to retry at after running out of memory", work=work)]
    return None if 0 in proposals else smallest(Plan(p, None) for p in proposals)
