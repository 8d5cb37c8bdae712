"""No rank waits past a bound (docs/design/worker.md, "Several ranks never hang"): an error on
one rank of a decode group reaches every rank within seconds, whatever the stage of the decode, and every rank raises:
the failing rank its own error, the others one naming that rank and the error's first line. The group decodes normally
afterwards (no rank was left behind in a collective).

Two real gloo ranks whose group timeout is long (120 s): a rank left waiting for a peer would wait that long. The stages
are the places where a rank's peers wait for it in a collective: the agreement before decoding (its request is built
from the plan, then exchanged), the status rounds of the decode, the round in which the ranks choose the plan to retry
at after running out of memory, and the agreement of that retry; and a `decode_iter` consumer that fails before its
first chunk while the other ranks' consumers iterate. Each error is injected on one rank, from the rank function: by
monkeypatching the decoder's planning or request, or through the op table it decodes with.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from _ranks import outcome, run_ranks
from _vae_helpers import random_latents

from fastvideo_pan2_ext.vae_kernel import TORCH_OPS, WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.distributed.agreement import DecodeRequest
from fastvideo_pan2_ext.vae_kernel.planning import memory

pytestmark = pytest.mark.slow

SHAPE = (1, 8, 3, 3, 4)  # 9 video frames, 3 latent rows over 2 ranks; 2 passes at 2 latent frames per pass
GROUP_TIMEOUT_S = 120  # how long a rank left waiting in a collective would wait
HEARD_WITHIN_S = 10  # every rank raises within this of the injected error (the decode itself takes well under a second)
HANG_LIMIT_S = 300  # the whole run, every stage included

# stage: (the failing rank, the error injected there, the error the other rank raises)
STAGES = {
    "planning": (1, RuntimeError, "failed before decoding: RuntimeError: injected: planning"),  # before the agreement
    "request": (0, RuntimeError, "failed before decoding: RuntimeError: injected: request"),  # the latents' checksum
    "decode": (1, RuntimeError, "failed while decoding: RuntimeError: injected: decode"),  # an op between exchanges
    "interrupt": (0, KeyboardInterrupt, "failed while decoding: KeyboardInterrupt: injected: interrupt"),
    "retry plan": (0, RuntimeError, "failed choosing the plan to retry at after running out of memory: RuntimeError: "
                                    "injected: retry plan"),
    "retry request": (1, RuntimeError, "failed before decoding: RuntimeError: injected: retry request"),
    "consumer": (0, RuntimeError, "failed while decoding: its consumer stopped iterating decode_iter"),
}
RETRIES = ("retry plan", "retry request")  # rank 1 runs out of memory at 2 latent frames per pass first


def _failing(stage: str, raised_at: list, calls: int = 1):
    """A replacement that raises the stage's injected error at its `calls`-th call (noting when), else runs `real`."""
    error = STAGES[stage][1]

    def wrap(real):
        count = [0]

        def replacement(*args, **kwargs):
            count[0] += 1
            if count[0] == calls:
                raised_at.append(time.time())
                raise error(f"injected: {stage}")
            return real(*args, **kwargs)

        return replacement

    return wrap


def _table(conv3d_wrap=None, out_of_memory_above_frames: int | None = None):
    """The portable op table, its conv3d wrapped, running out of memory past a number of output frames."""
    def conv3d(x, w, b, out, residual=None):
        if out_of_memory_above_frames is not None and out.shape[1] > out_of_memory_above_frames:
            raise torch.OutOfMemoryError(f"injected: conv3d output {list(out.shape)}")
        TORCH_OPS.conv3d(x, w, b, out, residual)

    return dataclasses.replace(TORCH_OPS, name="injected", conv3d=conv3d_wrap(conv3d) if conv3d_wrap else conv3d)


def _decode_with_failure(rank: int, stage: str, state_dict, z) -> dict:
    failing = STAGES[stage][0]
    raised_at: list[float] = []
    wrap = _failing(stage, raised_at)
    with pytest.MonkeyPatch.context() as mp:
        table = _table(out_of_memory_above_frames=4 if stage in RETRIES and rank == 1 else None)
        if rank == failing:
            if stage == "planning":
                mp.setattr(memory, "choose_plan", wrap(memory.choose_plan))
            elif stage == "request":
                mp.setattr(DecodeRequest, "of", wrap(DecodeRequest.of))
            elif stage in ("decode", "interrupt"):
                table = _table(_failing(stage, raised_at, calls=3))
            elif stage == "retry plan":
                mp.setattr(memory.MemoryPlanner, "retry_plan", wrap(memory.MemoryPlanner.retry_plan))
            elif stage == "retry request":  # the second of the decode
                mp.setattr(DecodeRequest, "of", _failing(stage, raised_at, calls=2)(DecodeRequest.of))
        decoder = WanVAEDecoder(state_dict, device="cpu", frames_per_pass=2, backend=table)

        def run():
            if stage != "consumer":
                return decoder.decode(z)
            if rank == failing:
                return _consumer_failing(decoder.decode_iter(z), raised_at)
            return list(decoder.decode_iter(z))

        result = outcome(run, (BaseException,))
        return {"outcome": result, "raised_at": time.time(), "injected_at": raised_at[0] if raised_at else None}


def _consumer_failing(chunks, raised_at: list) -> None:
    """A consumer of `decode_iter` that fails before taking the first chunk (e.g. its video writer would not start),
    and closes the iterator on its way out."""
    try:
        raised_at.append(time.time())
        raise RuntimeError("injected: consumer")
    finally:
        chunks.close()


def _rank(rank: int, world: int, tmp: str) -> dict:
    state_dict, z = torch.load(f"{tmp}/state_dict.pt"), torch.load(f"{tmp}/latents.pt")
    results = {stage: _decode_with_failure(rank, stage, state_dict, z) for stage in STAGES}
    results["after"] = outcome(lambda: WanVAEDecoder(state_dict, device="cpu", frames_per_pass=2,
                                                     backend="torch").decode(z))
    results["alone"] = WanVAEDecoder(state_dict, device="cpu", frames_per_pass=2, local=True,
                                     backend="torch").decode(z)
    return results


def test_an_error_on_one_rank_at_any_stage_reaches_every_rank_within_seconds(tmp_path, wan22_state_dict):
    torch.save(wan22_state_dict, tmp_path / "state_dict.pt")
    torch.save(random_latents(SHAPE, seed=23), tmp_path / "latents.pt")
    results = run_ranks(_rank, 2, tmp_path, group_timeout_s=GROUP_TIMEOUT_S, hang_limit_s=HANG_LIMIT_S)

    for stage, (failing, error, heard_as) in STAGES.items():
        injected_at = results[failing][stage]["injected_at"]
        assert injected_at is not None, f"{stage}: the error was never injected on rank {failing}"
        for rank, r in enumerate(results):
            expected = (error.__name__, f"injected: {stage}") if rank == failing else \
                ("RuntimeError", f"rank {failing} of the decode group {heard_as}")
            assert r[stage]["outcome"] == expected, (stage, rank)
            heard = r[stage]["raised_at"] - injected_at
            assert heard < HEARD_WITHIN_S, f"{stage}: rank {rank} raised {heard:.1f} s after the error on rank " \
                f"{failing}"
    r0, r1 = results
    assert r0["after"][0] == "ok" and torch.equal(r0["after"][1], r0["alone"]) and r1["after"] == ("ok", None)
