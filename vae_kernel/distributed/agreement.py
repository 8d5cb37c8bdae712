"""What every rank of a decode group agrees on before any work starts, so that bad or mismatched input on one rank
raises on every rank instead of leaving the others waiting in a collective."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a latent dtype travels as its index here


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """One rank's view of a decode: whether its input passed the checks, and what it asks for."""

    valid: bool
    shape: tuple[int, ...] = (-1,) * 5
    dtype_index: int = -1
    frames_per_pass: int = -1  # the option: an int, or 0 for "auto"
    architecture: int = -1  # a fingerprint of the decoder's config
    checksum: float = -1.0  # sum |latents|: the same latents on every rank
    planned_frames_per_pass: int = -1  # what this rank's plan chose (the group runs `memory.smallest`)

    @classmethod
    def of(cls, latents: torch.Tensor, frames_per_pass: int | str, planned: int, config) -> "DecodeRequest":
        return cls(True, tuple(latents.shape), _DTYPES.index(latents.dtype),
                   frames_per_pass if isinstance(frames_per_pass, int) else 0, hash(config) % (1 << 50),
                   float(latents.detach().double().abs().sum()), planned)

    def to_tensor(self) -> torch.Tensor:
        values = [float(self.valid), *self.shape, self.dtype_index, self.frames_per_pass, self.architecture,
                  self.checksum, self.planned_frames_per_pass]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "DecodeRequest":
        v = t.cpu().tolist()
        return cls(bool(v[0]), tuple(int(x) for x in v[1:6]), int(v[6]), int(v[7]), int(v[8]), v[9], int(v[10]))

    def same_decode(self, other: "DecodeRequest") -> bool:
        return (dataclasses.astuple(self)[:-2] == dataclasses.astuple(other)[:-2]
                and math.isclose(self.checksum, other.checksum, rel_tol=1e-9, abs_tol=1e-9))

    def __str__(self) -> str:
        dtype = _DTYPES[self.dtype_index] if 0 <= self.dtype_index < len(_DTYPES) else "?"
        option = self.frames_per_pass or "'auto'"
        return f"latents {list(self.shape)} {dtype}, frames_per_pass {option} (checksum {self.checksum:.6g})"


def supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def agree(pg, comm_device: torch.device, mine: DecodeRequest, error: str | None) -> list[int]:
    """Exchange every rank's request; raise ValueError on every rank if any rank's input failed (`error`: this
    rank's reason) or the ranks disagree. Returns every rank's planned frames per pass, in group rank order (the
    group runs the smallest plan: `planning.memory.smallest`)."""
    everyone = [torch.empty(11, dtype=torch.float64, device=comm_device) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine.to_tensor().to(comm_device), group=pg)
    if error:
        raise ValueError(error)
    requests = [DecodeRequest.from_tensor(tensor) for tensor in everyone]
    for rank, theirs in enumerate(requests):
        if not theirs.valid:
            raise ValueError(f"rank {rank} of the decode group rejected its latents; see that rank's error")
        if not theirs.same_decode(mine):
            raise ValueError(f"ranks disagree about the decode: rank {rank} has {theirs}; this rank has {mine}; "
                             "every rank must pass the same latents")
    return [request.planned_frames_per_pass for request in requests]


def gather_ints(pg, comm_device: torch.device, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same count on each), in group rank order: how the ranks settle a decode attempt
    (docs/design.md, "Out-of-memory retries")."""
    mine = torch.tensor(values, dtype=torch.int64, device=comm_device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine, group=pg)
    return [tensor.cpu().tolist() for tensor in everyone]
