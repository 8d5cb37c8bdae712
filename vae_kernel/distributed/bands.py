"""Row bands and their halo exchange: how one frame is split across ranks (and, run in turn, across tiles).

A frame's latent rows are split into contiguous bands. Every 3x3 conv reads one row above and one below each output
row, so before each such conv a band receives a 1-row halo from each neighbour (zeros at the frame's top and bottom
edge, which is exactly the conv's zero padding). The ops never know whether their rows are a whole frame: see
`ops.py`. Bands scale with the decoder's levels (a band of r latent rows is 2r rows after one upsample).

`LocalRows` is the single-band case (no communication); `RankRows` runs the bands of a torch.distributed process
group over point-to-point messages among the ranks that hold rows (a frame shorter than the group leaves the last
ranks idle).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OK, OUT_OF_MEMORY, FAILED = 0, 1, 2  # a rank's status in a decode attempt, by severity


class PeerFailed(RuntimeError):
    """Raised on every rank holding rows at the status round after another such rank failed (`statuses`: group rank
    -> OUT_OF_MEMORY or FAILED)."""

    def __init__(self, statuses: dict[int, int]) -> None:
        self.statuses = statuses
        super().__init__(f"ranks {sorted(statuses)} of the decode group failed")


def comm_device(pg, device: torch.device) -> torch.device:
    """Where the group's messages live: gloo moves CPU tensors only; NCCL moves the decoder's CUDA tensors directly."""
    return device if "nccl" in str(dist.get_backend(pg)).lower() else torch.device("cpu")


def split_rows(height: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """`height` rows as at most `parts` contiguous near-equal bands that start on multiples of `multiple` rows (the
    first ones one unit longer; the last may be shorter)."""
    if height < 1 or parts < 1:
        raise ValueError(f"need height >= 1 and parts >= 1; got height={height}, parts={parts}")
    units = -(-height // multiple)
    parts = min(parts, units)
    size, extra = divmod(units, parts)
    bands, start = [], 0
    for i in range(parts):
        stop = min(start + (size + (1 if i < extra else 0)) * multiple, height)
        bands.append((start, stop))
        start = stop
    return bands


class LocalRows:
    """The whole frame as one band: halos are the zero padding, gathers are the identity."""

    def __init__(self, height: int) -> None:
        self.height = height  # the frame's latent rows
        self.bands = [(0, height)]
        self.index = 0
        self.is_root = True

    @property
    def active(self) -> bool:
        """Whether this rank holds rows (a frame shorter than the group leaves the last ranks idle)."""
        return self.index < len(self.bands)

    @property
    def rows(self) -> tuple[int, int]:
        return self.bands[self.index]

    def exchange_halos(self, window: torch.Tensor) -> None:
        """window [F, rows + 2, W, C]: rows 0 and -1 are halos; at the frame edge they stay zero."""

    def all_rows(self, band: torch.Tensor) -> torch.Tensor:
        """band [F, rows, W, C] -> the whole frame's rows [F, H, W, C] (every band, in order)."""
        return band

    def gather_to_root(self, band: torch.Tensor) -> list[torch.Tensor] | None:
        """Each band's tensor (same shape except dim -2, the rows) on the root, in band order; None elsewhere."""
        return [band]

    def exchange_row_below(self, window: torch.Tensor) -> None:
        """window [F, rows + 1, W, C]: row -1 receives the next band's first row (zeros below the frame's last)."""

    def all_agree(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank holding rows (a step that skips its exchanges must be skipped by all)."""
        return flag

    def share_buffers(self, whole: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """The buffers `share` sends each band through, allocated inside an attempt (a failed allocation is then
        heard like any failure of the attempt)."""
        return []

    def share(self, whole: torch.Tensor, dim: int, buffers: list[torch.Tensor]) -> None:
        """whole: a tensor whose rows (dim `dim`) are the frame's, filled in this rank's band -> filled in every band,
        on every rank of the group, the idle ones too. After the attempt settled: every rank calls it."""


class RankRows(LocalRows):
    """The bands of a process group: group rank i holds band i; ranks past the last band hold none.

    Every exchange starts with a status round among the ranks holding rows (`check_peers`): a rank that failed since
    its last exchange (out of memory, or any error) joins that round with its status instead of the exchange, so
    every rank learns of it there, at its next exchange, rather than waiting for a message that never comes. The
    decoder runs one more round after a decode's last exchange (docs/design/worker.md, "Out-of-memory retries")."""

    def __init__(self, height: int, pg, device: torch.device, row_multiple: int = 1) -> None:
        self.pg, self.height = pg, height
        self.rank = dist.get_rank(pg)
        self.bands = split_rows(height, dist.get_world_size(pg), row_multiple)
        self.index = self.rank
        self.is_root = self.rank == 0
        self.comm_device = comm_device(pg, device)

    def _peer(self, index: int) -> int:
        return dist.get_global_rank(self.pg, index)

    def _post(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, tensor, self._peer(peer), self.pg) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, self._peer(peer), self.pg) for peer, tensor in recvs]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def check_peers(self, status: int = OK) -> None:
        """The status round: this rank's status to every other rank holding rows and theirs back; PeerFailed when
        any of theirs is not OK."""
        others = [j for j in range(len(self.bands)) if j != self.index]
        mine = torch.full((1,), status, dtype=torch.int32, device=self.comm_device)
        theirs = {j: torch.empty(1, dtype=torch.int32, device=self.comm_device) for j in others}
        self._post([(j, mine) for j in others], list(theirs.items()))
        failed = {j: s for j, s in ((j, int(t.item())) for j, t in theirs.items()) if s != OK}
        if failed:
            raise PeerFailed(failed)

    def _exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Send and receive (peer band index, tensor) pairs concurrently; received tensors are filled in place. Every
        buffer is allocated before the status round, so an allocation that fails is heard by the others there."""
        sends = [(peer, tensor.to(self.comm_device).contiguous()) for peer, tensor in sends]
        staged = [(peer, tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device=self.comm_device))
                  for peer, tensor in recvs]
        self.check_peers()
        self._post(sends, [(peer, buffer) for peer, _, buffer in staged])
        for _, tensor, buffer in staged:
            tensor.copy_(buffer)

    def exchange_halos(self, window: torch.Tensor) -> None:
        i, last = self.index, len(self.bands) - 1
        sends, recvs = [], []
        if i > 0:
            sends.append((i - 1, window[:, 1]))
            recvs.append((i - 1, window[:, 0]))
        if i < last:
            sends.append((i + 1, window[:, -2]))
            recvs.append((i + 1, window[:, -1]))
        self._exchange(sends, recvs)

    def _band_shape(self, band: torch.Tensor, index: int, dim: int) -> list[int]:
        scale = band.shape[dim] // (self.bands[self.index][1] - self.bands[self.index][0])
        shape = list(band.shape)
        shape[dim] = scale * (self.bands[index][1] - self.bands[index][0])
        return shape

    def all_rows(self, band: torch.Tensor) -> torch.Tensor:
        parts = [band if j == self.index else torch.empty(self._band_shape(band, j, 1), dtype=band.dtype,
                                                           device=band.device) for j in range(len(self.bands))]
        others = [j for j in range(len(self.bands)) if j != self.index]
        self._exchange([(j, band) for j in others], [(j, parts[j]) for j in others])
        return torch.cat(parts, dim=1)

    def all_agree(self, flag: bool) -> bool:
        others = [j for j in range(len(self.bands)) if j != self.index]
        theirs = {j: torch.empty(1, dtype=torch.int32) for j in others}
        self._exchange([(j, torch.tensor([int(flag)], dtype=torch.int32)) for j in others], list(theirs.items()))
        return flag and all(bool(t.item()) for t in theirs.values())

    def exchange_row_below(self, window: torch.Tensor) -> None:
        i, last = self.index, len(self.bands) - 1
        self._exchange([(i - 1, window[:, 0])] if i > 0 else [], [(i + 1, window[:, -1])] if i < last else [])

    def share_buffers(self, whole: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [torch.empty_like(whole.narrow(dim, start, stop - start), device=self.comm_device,
                                 memory_format=torch.contiguous_format) for start, stop in self.bands]

    def share(self, whole: torch.Tensor, dim: int, buffers: list[torch.Tensor]) -> None:
        for j, ((start, stop), staged) in enumerate(zip(self.bands, buffers)):
            rows = whole.narrow(dim, start, stop - start)
            if j == self.index:
                staged.copy_(rows)
            dist.broadcast(staged, self._peer(j), group=self.pg)
            if j != self.index:
                rows.copy_(staged)

    def gather_to_root(self, band: torch.Tensor) -> list[torch.Tensor] | None:
        if not self.is_root:
            self._exchange([(0, band)], [])
            return None
        parts = [band] + [torch.empty(self._band_shape(band, j, -2), dtype=band.dtype, device=band.device)
                          for j in range(1, len(self.bands))]
        self._exchange([], [(j, parts[j]) for j in range(1, len(self.bands))])
        return parts
