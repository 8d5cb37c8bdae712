"""Out-of-memory retries (docs/design/worker.md, "Out-of-memory retries"): a decode whose op runs out of memory decodes
again from the start at a smaller plan and gives the video a decode planned that way from the start gives, bit for bit;
the smallest plan failing raises with every plan tried; decode_iter restarts (DecodeRestart) once it has yielded
frames, and the streamed save rewrites its file; two real gloo ranks with the failure on rank 1 alone retry together
(or all raise) without hanging.

The out-of-memory errors are injected from outside the product: an `ops.Ops` table passed as `backend=` whose conv3d
raises torch.OutOfMemoryError above a size, or (for FastVideo's VAE, whose decoder picks its own table, and for a
real failure of torch's CPU allocator) the torch conv the portable ops call.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from _ranks import outcome, run_ranks
from _vae_helpers import fastvideo_wan_vae_of, random_latents

from fastvideo_pan2_ext.vae_kernel import TORCH_OPS, WanVAEDecoder
from fastvideo_pan2_ext.vae_kernel.decoder import DecodeOutOfMemoryError, DecodePlan, DecodeRestart
from fastvideo_pan2_ext.vae_kernel.portable import ops

SHAPE = (1, 8, 3, 3, 4)  # 9 video frames of 48 x 64: 2 passes at 2 frames per pass, 3 at 1
# Tiles hold less than the whole frame only where the frame is taller than a tile's margins reach: 6 latent rows,
# where 1-row tiles at 1 frame per pass hold under 3/4 of the untiled peak (2 rows hold more).
TALL = (1, 8, 3, 6, 2)
RETRY_WARNING = "ran out of memory at"
# More bytes than any machine can map: torch's CPU allocator fails at once, touching nothing, and raises its own error
# (a RuntimeError saying "DefaultCPUAllocator: can't allocate memory", not torch.OutOfMemoryError).
UNMAPPABLE_BYTES = 2 ** 60


def limited(frames: int | None = None, elements: int | None = None, fail_calls: int = 0, error=None):
    """The portable op table whose conv3d raises torch.OutOfMemoryError when its output holds more than `frames`
    frames or more than `elements` elements, or on its first `fail_calls` calls (a passing shortage); `error`: an
    exception type raised instead of out of memory."""
    calls = [0]

    def conv3d(x, w, b, out, residual=None):
        calls[0] += 1
        if (frames is not None and out.shape[1] > frames) or (elements is not None and out.numel() > elements) \
                or calls[0] <= fail_calls:
            raise (error or torch.OutOfMemoryError)(f"injected: conv3d output {list(out.shape)}")
        TORCH_OPS.conv3d(x, w, b, out, residual)

    return dataclasses.replace(TORCH_OPS, name="limited", conv3d=conv3d)


def recording():
    """The portable table, recording the largest conv3d output (elements)."""
    largest = [0]

    def conv3d(x, w, b, out, residual=None):
        largest[0] = max(largest[0], out.numel())
        TORCH_OPS.conv3d(x, w, b, out, residual)

    return dataclasses.replace(TORCH_OPS, name="recording", conv3d=conv3d), largest


def convs_out_of_memory_above(monkeypatch, frames: int, run_out) -> None:
    """The torch convs the portable ops call (oneDNN's, from the prepared or the prepacked weights: `ops.prepack`)
    call `run_out(frames_out)`, which raises, for an output of more than `frames` frames. On a CPU computing in fp32
    each oneDNN call holds one frame (`ops._fp32_row_blocks`), so there the conv of the whole pass runs out first."""
    def limit(real):
        def conv(x, w, *args):
            frames_out = x.shape[2] - w.shape[2] + 1 if x.dim() == 5 else 1
            if frames_out > frames:
                run_out(frames_out)
            return real(x, w, *args)
        return conv

    monkeypatch.setattr(torch, "mkldnn_convolution", limit(torch.mkldnn_convolution))
    monkeypatch.setattr(torch.ops.mkldnn, "_convolution_pointwise", limit(torch.ops.mkldnn._convolution_pointwise))
    monkeypatch.setattr(ops, "_fp32_row_blocks", limit(ops._fp32_row_blocks))


def joined(chunks) -> torch.Tensor:
    parts = []
    for _, frame, chunk in chunks:
        assert frame == sum(p.shape[2] for p in parts)
        parts.append(chunk)
    return torch.cat(parts, dim=2)


def retry_warnings(caplog) -> list[str]:
    """The retry warnings logged, each once (a record reaches caplog's handler once per logger it is attached to, and
    whether FastVideo's logging setup stops propagation depends on what ran before)."""
    records = {id(r): r for r in caplog.records if r.levelno == logging.WARNING and RETRY_WARNING in r.getMessage()}
    return [r.getMessage() for r in records.values()]


@pytest.fixture(scope="module")
def z():
    return random_latents(SHAPE, seed=21)


@pytest.fixture(scope="module")
def z_tall():
    return random_latents(TALL, seed=22)


@pytest.fixture(scope="module")
def at_one(wan22_state_dict, z):
    """The decode planned at 1 frame per pass from the start, and its largest conv3d output."""
    table, largest = recording()
    video = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=1, backend=table).decode(z)
    return video, largest[0]


@pytest.mark.parametrize("frames_per_pass", [2, "auto"])
def test_out_of_memory_retries_at_fewer_frames_per_pass_with_the_same_video(wan22_state_dict, z, at_one, caplog,
                                                                            frames_per_pass):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=frames_per_pass,
                            backend=limited(frames=4))  # 1 latent frame per pass makes at most 4 video frames
    first = decoder.plan(SHAPE)
    assert first.frames_per_pass == 2  # "auto" on CPU: the most a 3-frame clip can use
    with caplog.at_level(logging.WARNING):
        video = decoder.decode(z)
    assert decoder.last_plan == DecodePlan(1, None) and decoder.last_retries == (first,)
    assert torch.equal(video, at_one[0])
    [warning] = retry_warnings(caplog)
    assert "2 latent frames per pass, untiled" in warning and "again from the start at 1 latent frame per pass" \
        in warning
    assert decoder.plan(SHAPE) == DecodePlan(1, None)  # the next decode of this shape starts at the retried plan


def test_out_of_memory_at_one_frame_per_pass_retries_in_exact_tiles(wan22_state_dict, z_tall, caplog):
    z = z_tall
    table, largest = recording()
    tiled = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=1, tile_rows=1, backend=table).decode(z)
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=1, backend=limited(elements=largest[0]))
    with caplog.at_level(logging.WARNING):
        video = decoder.decode(z)
    plan = decoder.last_plan
    assert plan.frames_per_pass == 1 and plan.tile_rows is not None and decoder.last_retries[0] == (1, None)
    direct = tiled if plan.tile_rows == 1 else \
        WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=1, tile_rows=plan.tile_rows,
                      backend="torch").decode(z)
    assert torch.equal(video, direct)
    assert len(retry_warnings(caplog)) == len(decoder.last_retries)


def test_the_smallest_plan_failing_raises_with_every_plan_tried(wan22_state_dict, z_tall, caplog):
    z = z_tall
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend=limited(elements=10))
    with caplog.at_level(logging.WARNING), pytest.raises(DecodeOutOfMemoryError) as info:
        decoder.decode(z)
    error = info.value
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, torch.cuda.OutOfMemoryError)
    assert error.plans[0] == (2, None) and error.plans[-1] == (1, 1) and len(set(error.plans)) == len(error.plans)
    message = str(error)
    assert "the smallest included" in message and "injected: conv3d output" in message
    assert all(str(plan) in message for plan in error.plans)
    assert len(retry_warnings(caplog)) == len(error.plans) - 1  # one line per retry


def test_a_cpu_allocator_out_of_memory_is_retried_with_the_same_video(wan22_state_dict, z, cpu_compute, monkeypatch,
                                                                     caplog):
    """torch's CPU allocator reports running out of memory as a RuntimeError of its own: a conv whose allocation
    really fails there is retried as on a GPU, on either kind of CPU (computing in bf16, inside the prepacked conv,
    which does not take it for the private op refusing its arguments)."""
    undisturbed = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=1, backend="torch").decode(z)
    convs_out_of_memory_above(monkeypatch, 4, lambda frames: torch.empty(UNMAPPABLE_BYTES, dtype=torch.uint8))
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")
    with caplog.at_level(logging.WARNING):
        video = decoder.decode(z)
    assert decoder.last_plan == (1, None) and decoder.last_retries == ((2, None),)
    assert torch.equal(video, undisturbed)
    [warning] = retry_warnings(caplog)
    assert f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {UNMAPPABLE_BYTES} bytes" in warning
    convs = [w for name, w in decoder.weights.items() if w.dim() >= 5 and name != "post_quant_conv.weight"]
    prepacked = [ops.prepacked(w) for w in convs]
    assert all(prepacked) if cpu_compute == torch.bfloat16 else not any(prepacked)  # the private ops still serve


@pytest.mark.parametrize("error", [KeyError, lambda text: RuntimeError(
    f"CUDA error: an illegal memory access was encountered ({text})")], ids=["KeyError", "RuntimeError"])
def test_a_non_memory_error_is_not_retried(wan22_state_dict, z, error):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend=limited(fail_calls=1,
                                                                                                error=error))
    with pytest.raises((KeyError, RuntimeError), match="injected"):
        decoder.decode(z)
    assert decoder.last_retries == ()


def test_decode_iter_retries_unseen_before_its_first_chunk(wan22_state_dict, z, at_one, caplog):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend=limited(fail_calls=1))
    with caplog.at_level(logging.WARNING):
        video = joined(decoder.decode_iter(z))
    assert decoder.last_plan == (1, None) and decoder.last_retries == ((2, None),)
    assert torch.equal(video, at_one[0]) and len(retry_warnings(caplog)) == 1


def test_decode_iter_after_its_first_chunk_raises_decode_restart_and_restarts(wan22_state_dict, z, at_one, caplog):
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend=limited(frames=4))
    received = []
    with caplog.at_level(logging.WARNING), pytest.raises(DecodeRestart) as info:
        for item in decoder.decode_iter(z):
            received.append(item)
    assert len(received) == 1  # the first frame went alone and was out before the 2-frame pass failed
    assert info.value.plan == (1, None) and isinstance(info.value, torch.OutOfMemoryError)
    assert "iterate decode_iter again" in str(info.value)
    video = joined(decoder.decode_iter(z))  # the consumer starts again
    assert torch.equal(video, at_one[0])
    assert decoder.last_plan == (1, None) and decoder.last_retries == ((2, None),)
    assert len(retry_warnings(caplog)) == 1


# ----------------------------------------------------------------------------------------------- the streamed save


def _fastvideo_vae(wan22_vae, frames_per_pass):
    """FastVideo's own Wan VAE module with the narrow model's weights, the fast decoder on."""
    return fastvideo_wan_vae_of(wan22_vae, decode_kernel=True, decode_frames_per_pass=frames_per_pass)


def test_the_streamed_save_rewrites_its_file_after_a_restart(wan22_vae, z, tmp_path, monkeypatch, caplog):
    from fastvideo_pan2_ext.fastvideo_integration import fast_decode, streamed_save

    streamed_save.write_while_decoding(_fastvideo_vae(wan22_vae, 1), z, streamed_save.StreamedSaveRequest(
        str(tmp_path / "undisturbed.mp4"), 24))

    target = tmp_path / "out" / "video.mp4"
    target.parent.mkdir()
    seen_at_failure = []

    def run_out(frames):
        seen_at_failure.append(target.exists())
        raise torch.OutOfMemoryError(f"injected: {frames} frames")

    convs_out_of_memory_above(monkeypatch, 4, run_out)
    vae = _fastvideo_vae(wan22_vae, 2)
    loggers = [logging.getLogger(name) for name in (streamed_save.__name__, "fastvideo_pan2_ext.vae_kernel.decoder")]
    for logger in loggers:  # FastVideo's logging setup does not propagate to the root logger
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            streamed_save.write_while_decoding(vae, z, streamed_save.StreamedSaveRequest(str(target), 24))
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    # It failed once, after frames had been handed to the writer (a restart, not a first-pass failure), with nothing
    # at the target. Whether ffmpeg has created the partial file by then is its own timing, so not asserted.
    assert seen_at_failure == [False]
    assert target.read_bytes() == (tmp_path / "undisturbed.mp4").read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["video.mp4"]
    decoder = fast_decode.decoder_for(vae, z.device)
    assert decoder.last_plan == (1, None) and decoder.last_retries == ((2, None),)
    assert any("restarts at the decoder's smaller plan" in r.getMessage() for r in caplog.records)
    assert len(retry_warnings(caplog)) == 1


# ------------------------------------------------------------------------------------------ two real gloo ranks

GROUP_TIMEOUT_S = 60
HANG_LIMIT_S = 300


def _restarting(decoder, z):
    """A decode_iter consumer that starts again on DecodeRestart (as the streamed save does)."""
    while True:
        try:
            chunks = list(decoder.decode_iter(z))
            return None if chunks[0][2] is None else torch.cat([c for _, _, c in chunks], dim=2)
        except DecodeRestart:
            continue


def _plans(decoder):
    return tuple(decoder.last_plan), tuple(tuple(plan) for plan in decoder.last_retries)  # plain tuples pickle safely


def _rank(rank: int, world: int, tmp: str) -> dict:
    results = {}
    sd, z = torch.load(f"{tmp}/state_dict.pt"), torch.load(f"{tmp}/latents.pt")

    def decoder(table="torch", **kwargs):
        return WanVAEDecoder(sd, device="cpu", frames_per_pass=2, backend=table if rank == 1 else "torch", **kwargs)

    results["undisturbed"] = WanVAEDecoder(sd, device="cpu", frames_per_pass=1, local=True,
                                           backend="torch").decode(z)
    short = decoder(limited(frames=4))
    results["decode"] = outcome(lambda: short.decode(z))
    results["decode_plans"] = _plans(short)
    streamed = decoder(limited(frames=4))
    results["decode_iter"] = outcome(lambda: _restarting(streamed, z))
    results["decode_iter_plans"] = _plans(streamed)
    results["smallest"] = outcome(lambda: decoder(limited(frames=0)).decode(z))
    results["error"] = outcome(lambda: decoder(limited(fail_calls=3, error=KeyError)).decode(z))
    results["after"] = outcome(lambda: decoder().decode(z))  # the group still works
    return results


@pytest.mark.slow
def test_two_gloo_ranks_with_the_failure_on_rank_1_retry_together(tmp_path, wan22_state_dict, z):
    torch.save(wan22_state_dict, tmp_path / "state_dict.pt")
    torch.save(z, tmp_path / "latents.pt")
    r0, r1 = run_ranks(_rank, 2, tmp_path, group_timeout_s=GROUP_TIMEOUT_S, hang_limit_s=HANG_LIMIT_S)

    expected = r0["undisturbed"]
    for name in ("decode", "decode_iter"):
        assert r0[name][0] == "ok" and torch.equal(r0[name][1], expected), name
        assert r1[name] == ("ok", None), name
        assert r0[f"{name}_plans"] == r1[f"{name}_plans"] == ((1, None), ((2, None),)), name
    for r in (r0, r1):  # the smallest plan fails on rank 1: both raise, having tried the same plans
        status, message = r["smallest"]
        assert status == "DecodeOutOfMemoryError" and "2 latent frames per pass, untiled; 1 latent frame per pass, " \
            "untiled" in message, r["smallest"]
    assert r1["error"][0] == "KeyError" and "injected" in r1["error"][1]
    assert r0["error"] == ("RuntimeError",  # rank 1's own error, by name and first line
                           f"rank 1 of the decode group failed while decoding: KeyError: {r1['error'][1]}")
    assert r0["after"][0] == "ok" and torch.equal(r0["after"][1], expected) and r1["after"] == ("ok", None)
