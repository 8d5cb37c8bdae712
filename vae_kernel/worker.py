"""The worker core under `WanVAEDecoder` and `WanVAEEncoder` (docs/design/worker.md, "One worker core").

What a decode and an encode share, once: where the work runs (`module_device`, `resolve_device`, `resolve_group`),
the prepared weights that follow the VAE (`Worker.sync_weights`, `follow_vae`, `release_weights`), the tiling
options (`enable_tiling`, `set_max_memory`, `disable_tiling`), the plan's ceiling after a retry, the ranks'
agreement on the input and the plan before any work (`Worker._agreed_plan`), and the attempts: each runs from the
start at its plan, every rank of a group settles it (`agreement.settle`), and one that ran out of memory anywhere is
tried again at the plan below it (`Worker._attempts`, `Worker._retry`), or raises `VAEOutOfMemoryError` once none is
left. The decoder (`decoder.py`) and the encoder (`encoder.py`) add their input checks, their plans and their
passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import options as options_mod
from .distributed.agreement import AttemptFailed, Request, agree, failure, finish, retry_choice, settle
from .distributed.bands import FAILED, OK, LocalRows, RankRows, comm_device
from .planning import memory
from .planning.memory import Plan


def module_device(vae_or_state_dict):
    """Where a module's weights are (a worker's default device); "cuda" for a state dict or a weightless module."""
    if isinstance(vae_or_state_dict, torch.nn.Module):
        weight = next(vae_or_state_dict.parameters(), None)
        if weight is not None and weight.device.type != "meta":
            return weight.device
    return "cuda"


def resolve_device(device, work: str = "decode") -> torch.device:
    """`device` (a torch device or its name) as a torch device, "cuda" as the current GPU; ValueError for a name
    torch does not know or a GPU torch does not see."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device or its name; got {device!r} (names are such as 'cuda', "
                         "'cuda:1', 'cpu')") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available (torch sees no GPU here): "
                             f"{work} on the CPU (device='cpu')")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_group(pg, local: bool):
    """The process group a worker splits its rows over: `pg`, by default the initialized default group; None with
    `local=True` or a group of one rank (it works alone then, and may tile: e.g. a one-GPU FastVideo process)."""
    if pg is None and not local and dist.is_available() and dist.is_initialized():
        pg = dist.group.WORLD
    return None if local or pg is None or dist.get_world_size(pg) == 1 else pg


class VAEOutOfMemoryError(torch.OutOfMemoryError):
    """A decode or an encode ran out of memory at every plan it tried, the smallest included (`plans`: each, in
    order)."""

    def __init__(self, message: str, plans: tuple[Plan, ...]) -> None:
        super().__init__(message)
        self.plans = plans


@dataclasses.dataclass
class Job:
    """One call's work as its attempts and retries see it."""

    input: torch.Tensor  # the latents (the video)
    shape: tuple[int, ...]  # its latents' shape, which the ranks split in bands
    what: str  # the input as messages name it
    key: tuple  # the plan ceiling's key
    planner: memory.MemoryPlanner
    stream: bool  # decode_iter's chunks, which a retry cannot take back
    tried: list[Plan]  # the plans that ran out of memory, in order


class Worker:
    """What `WanVAEDecoder` and `WanVAEEncoder` share (see the module). A subclass sets `WORK` ("decode",
    "encode"), `OUT_OF_MEMORY` (its `VAEOutOfMemoryError`), `ops`, `config`, `_weights` (`weights.PreparedWeights`)
    and `options`, and calls `_place` and `_tiling` from its constructor."""

    WORK = "decode"
    OUT_OF_MEMORY: type[VAEOutOfMemoryError] = VAEOutOfMemoryError

    def _place(self, vae_or_state_dict, device, pg, local: bool) -> None:
        """Where this worker runs: its device (default: the module's, `module_device`) and its group of ranks."""
        self.device = resolve_device(module_device(vae_or_state_dict) if device is None else device, self.WORK)
        self.pg = resolve_group(pg, local)
        self._comm_device = None if self.pg is None else comm_device(self.pg, self.device)
        self._ceilings: dict[tuple, Plan] = {}  # a shape -> the plan a retry chose: plans stay below it
        self.last_plan: Plan | None = None  # what the latest call ran (the ranks' agreed plan)
        # The plans the latest call ran out of memory at, in order (docs/design/worker.md, "Out-of-memory retries");
        # empty when the first plan held.
        self.last_retries: tuple[Plan, ...] = ()

    @property
    def backend(self) -> str:
        return self.ops.name

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The prepared weights (name -> tensor, in execution order; empty while released)."""
        return self._weights.tensors

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0 of the group, or a single-rank worker."""
        return self.pg is None or dist.get_rank(self.pg) == 0

    @property
    def _ranks(self) -> int:
        return 1 if self.pg is None else dist.get_world_size(self.pg)

    def _rows(self, height: int) -> LocalRows:
        """This rank's latent rows of a frame `height` latent rows high (all of them, alone)."""
        return LocalRows(height) if self.pg is None else RankRows(height, self.pg, self.device, self.ops.row_multiple)

    # ---------------------------------------------------------------------------------------------------------------
    # The weights follow the VAE (weights.PreparedWeights; docs/design/worker.md, "What a weight change costs")
    # ---------------------------------------------------------------------------------------------------------------

    def sync_weights(self) -> bool:
        """Bring the prepared weights in step with the VAE this worker was made from (every decode and encode does
        this first); True when any changed. A new architecture is taken too (the plans of the old one are dropped)."""
        changed = self._take_weights()
        if self._weights.config != self.config or self._plans_stale():
            self.config = self._weights.config
            self._drop_plans()
        return changed

    def release_weights(self) -> None:
        """Free the prepared weights (the VAE left this worker's device); the next call prepares them again from the
        VAE. ValueError for a worker made from a state dict (they are its only copy)."""
        self._weights.release()

    def follow_vae(self) -> None:
        """Call after the VAE this worker was made from moved (`.to()`): when its weights are no longer on this
        worker's device, the prepared weights leave it too (`release_weights`)."""
        where = self._weights.module_device()
        if where is not None and where != self.device and self.weights:
            self.release_weights()

    def _take_weights(self) -> bool:
        """Take any change of the VAE's weights (`sync_weights`); True when any changed."""
        return self._weights.sync()

    def _plans_stale(self) -> bool:
        """Whether the plans made so far no longer hold (beyond a new architecture)."""
        return False

    def _drop_plans(self) -> None:
        self._ceilings.clear()

    # ---------------------------------------------------------------------------------------------------------------
    # Tiling (exact tiles, one rank) and the plan
    # ---------------------------------------------------------------------------------------------------------------

    def _tiling(self, opts) -> None:
        self.tile_rows: int | None = None
        self.max_memory: int | None = None
        if opts.tile_rows is not None:
            self.enable_tiling(opts.tile_rows)
        if opts.max_memory is not None:
            self.set_max_memory(opts.max_memory)

    def enable_tiling(self, tile_rows: int) -> None:
        """Work in tiles of `tile_rows` latent rows, one after another (exact; peak memory falls with the tile)."""
        options_mod.check({"tile_rows": tile_rows}, part=self.WORK)
        if self.pg is not None:
            raise ValueError(f"tiled {self.WORK} runs on one rank: pass local=True (or no process group) to use "
                             "tile_rows")
        self.tile_rows, self.max_memory = tile_rows, None

    def set_max_memory(self, max_memory: int | str) -> None:
        """Choose the tile per shape so that the peak working memory fits `max_memory` bytes."""
        budget = memory.parse_bytes(max_memory)
        if self.pg is not None:
            raise ValueError(f"max_memory tiles the {self.WORK}, which runs on one rank: pass local=True (or no "
                             "process group)")
        self.tile_rows, self.max_memory = None, budget

    def disable_tiling(self) -> None:
        self.tile_rows = self.max_memory = None

    def _capped(self, planned: Plan, key: tuple) -> Plan:
        """`planned`, or the plan a retry of this shape chose when that is smaller: never larger than a plan that ran
        out of memory taught."""
        ceiling = self._ceilings.get(key)
        return planned if ceiling is None or planned.size() <= ceiling.size() else ceiling

    # ---------------------------------------------------------------------------------------------------------------
    # Start-up: every rank agrees before any work starts
    # ---------------------------------------------------------------------------------------------------------------

    def _fingerprint(self) -> Any:
        """What the ranks' setups must share beyond the input (hashed): the architecture."""
        return self.config

    def _agreed_plan(self, checked: Callable[[], tuple[torch.Tensor, Plan]], frames_per_pass) -> Plan:
        """The plan of this call: `checked()` checks the input (ValueError when it is bad) and plans it, (the input as
        the ranks compare it, this rank's plan). The ranks of a group first agree on both (`agreement.agree`: an
        error on one rank, whatever it is, raises on all; they run the `memory.smallest` of their plans)."""
        if self.pg is None:
            return checked()[1]

        def request() -> Request:
            given, plan = checked()
            return Request.of(given, frames_per_pass, plan.frames_per_pass, self._fingerprint(),
                              self._weights.checksum())

        return memory.smallest(Plan(fpp, None) for fpp in agree(self.pg, self._comm_device, request, self.WORK))

    # ---------------------------------------------------------------------------------------------------------------
    # The attempts and their retries (docs/design/worker.md, "Out-of-memory retries")
    # ---------------------------------------------------------------------------------------------------------------

    def _attempts(self, job: Job, start: tuple[Plan, LocalRows],
                  attempt: Callable[[Plan, LocalRows], tuple[Iterator, int]],
                  deliver: Callable[[Any], None] | None = None, discard: Callable[[], None] | None = None,
                  primed: bool = True) -> Iterator:
        """Every attempt of one call: each runs from the start at its plan (`attempt(plan, rows)`: its items and how
        many it makes on this rank); the ranks of a group settle each one together (`agreement.settle`). Each item
        goes to `deliver`, or, without one, is yielded (then no retry can take it back). `discard()` drops what a
        failed attempt left. Not `primed`: the first `next` runs to just before the first attempt's first item, so
        that from there on, closing the iterator tells the group."""
        yielded = False
        plan, rows = start
        while True:
            self.last_plan = plan
            items = error = None
            try:
                try:
                    items, remaining = attempt(plan, rows)
                    if not primed:
                        primed = True
                        yield None
                    for item in items:
                        remaining -= 1
                        if deliver is None:
                            yielded = True  # the consumer has it: a retry cannot take it back
                            yield item
                        else:
                            deliver(item)
                        del item  # not held while the next one is made
                except GeneratorExit:  # the consumer stopped: the group hears of it unless every item was out
                    status = OK if remaining <= 0 else FAILED
                    finish(rows, status)
                    try:
                        settle(rows, status, None, False, f"its consumer stopped iterating {self.WORK}_iter",
                               work=self.WORK)
                    except AttemptFailed:
                        pass
                    raise
                finish(rows, OK)
                settle(rows, OK, None, yielded, work=self.WORK)
                break
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - the group hears of any failure, an interrupt too
                error = exc  # raised again below, on this rank
            finally:
                if items is not None and hasattr(items, "close"):
                    items.close()  # drops the attempt's tensors
                items = None
            if discard is not None:
                discard()
            failed = failure(error, rows, yielded, self.WORK)
            error = None
            if failed.error is not None:
                raise failed.error
            if failed.status == FAILED:
                raise failed.peer_error
            plan, rows = self._retry(job, plan, failed, rows)
        self.last_retries = tuple(job.tried)
        job.tried.clear()

    def _retry(self, job: Job, failed: Plan, attempt: AttemptFailed,
               rows: LocalRows) -> tuple[Plan, LocalRows]:
        """After an out-of-memory attempt (on any rank): release what it held, choose the plan below it (the ranks
        take the `memory.smallest` of their proposals, in a round that a rank whose choice fails joins too:
        `agreement.retry_choice`), and start again there (`_resume`); `OUT_OF_MEMORY` when no smaller plan is
        left."""
        job.tried.append(failed)

        def proposal() -> Plan | None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            shape = memory.band_shape(job.shape, self._ranks, self.ops.row_multiple)
            return job.planner.retry_plan(shape, failed.frames_per_pass, failed.tile_rows, job.stream,
                                          may_tile=self.pg is None)

        smaller = retry_choice(self.pg, self._comm_device, proposal, self.WORK)
        if smaller is None:
            self.last_retries = tuple(job.tried)
            job.tried.clear()
            raise self.OUT_OF_MEMORY(f"the VAE {self.WORK} of {job.what} ran out of memory at every plan it tried, "
                                     f"the smallest included: {'; '.join(map(str, self.last_retries))} "
                                     f"({attempt.text})", self.last_retries) from None
        self._ceilings[job.key] = smaller
        return self._resume(job, failed, smaller, attempt, rows)

    def _resume(self, job: Job, failed: Plan, smaller: Plan, attempt: AttemptFailed,
                rows: LocalRows) -> tuple[Plan, LocalRows]:
        """Where the next attempt starts after `failed` ran out of memory and the ranks chose `smaller`."""
        raise NotImplementedError
