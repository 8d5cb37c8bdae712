"""Real ranks for tests: `run_ranks(fn, world, tmp, *args)` runs `fn(rank, world, tmp, *args)` in `world` spawned
processes, each a rank of one gloo group (a file rendezvous in `tmp`; `group=False`: `fn` sets up its own, as
FastVideo's workers do), and returns what each rank's `fn` returned. A rank that crashes, dies without an answer or
is still running after `hang_limit_s` fails the test, naming the rank.

`fn` must be a module-level function (it is pickled into the ranks) and its answer something `torch.load` reads back
with weights_only (tensors, numbers, strings, tuples, lists, dicts).
"""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 120  # a collective that waits longer raises (the product's bound for a rank that never comes)
HANG_LIMIT_S = 600


def outcome(fn, errors: tuple[type[BaseException], ...] = (Exception,)):
    """("ok", fn()) or (the error's type name, its message) for the errors a rank reports instead of raising."""
    try:
        return ("ok", fn())
    except errors as exc:
        return (type(exc).__name__, str(exc))


def _rank_main(rank: int, world: int, tmp: str, fn, args: tuple, threads: int, group: bool,
               group_timeout_s: float) -> None:
    torch.set_num_threads(threads)
    if group:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        answer = {"value": fn(rank, world, tmp, *args)}
    except BaseException:  # noqa: BLE001 - reported to the test, with its traceback
        answer = {"crash": traceback.format_exc()}
    torch.save(answer, f"{tmp}/rank{rank}.pt")
    if group:
        if "crash" not in answer:
            dist.barrier()  # no rank leaves the group while another is still in it
        dist.destroy_process_group()


def run_ranks(fn, world: int, tmp, *args, threads: int = 1, group: bool = True,
              group_timeout_s: float = GROUP_TIMEOUT_S, hang_limit_s: float = HANG_LIMIT_S) -> list:
    """Each rank's answer, rank 0 first (see the module notes)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp), fn, args, threads, group, group_timeout_s))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + hang_limit_s
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:  # every rank is stopped, even when the test is interrupted
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert not hung, f"ranks {hung} hung (still running after {hang_limit_s:.0f} s)"
    answers = []
    for r, p in enumerate(procs):
        path = Path(tmp) / f"rank{r}.pt"
        assert path.exists(), f"rank {r} exited with code {p.exitcode} without an answer"
        answer = torch.load(path)
        assert "crash" not in answer, f"rank {r} crashed:\n{answer['crash']}"
        answers.append(answer["value"])
    return answers
