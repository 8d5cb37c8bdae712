"""`WanVAEEncoder` against diffusers' own encode, and its plans against each other.

The fast encoder is another code path than diffusers' (other kernels, another operand layout), so it is judged by a
bound (fp32: rounding; bf16: the allowance against diffusers' bf16 encode), mean and logvar separately. Its plans
(frames per pass, two-phase tiles, batch samples, the steady reuse) run the same ops on the same inputs and are
compared bit for bit, at one thread (`_threads.torch_threads`: oneDNN may block a sum differently at another thread
count and other extents).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from _threads import torch_threads
from _vae_helpers import make_wan21_vae, make_wan22_vae
from fastvideo_pan2_ext.vae_kernel.definitions.allowance import compare_to_reference
from fastvideo_pan2_ext.vae_kernel.encoder import EncodeOutOfMemoryError, WanVAEEncoder
from fastvideo_pan2_ext.vae_kernel.planning.memory import LiveBytes
from fastvideo_pan2_ext.vae_kernel.portable import encoder_network, passes
from fastvideo_pan2_ext.vae_kernel.portable.ops import TORCH_OPS
from fastvideo_pan2_ext.vae_kernel.compiled.kernels import BY_DESIGN, make_ops
from gpu_check.emulated_extension import EmulatedExtension

LAYOUTS = {  # (a seeded narrow VAE, a video size it takes: Wan2.1 odd on purpose, Wan2.2 a multiple of 16)
    "wan21": (lambda: make_wan21_vae(seed=3, base_dim=8, z_dim=16), (45, 59)),
    "wan22": (lambda: make_wan22_vae(seed=3, base_dim=8, z_dim=48), (64, 80)),
}


TALL = {"wan21": (197, 24), "wan22": (384, 32)}  # frames whose tiles hold fewer rows than the frame (margins: 9 rows)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request):
    make, size = LAYOUTS[request.param]
    return request.param, make(), size


def _video(size, frames: int = 9, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((batch, 3, frames, *size), generator=g) * 2 - 1


def _diffusers(vae, video, dtype=torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return vae.to(dtype).encode(video.to(dtype)).latent_dist.parameters.float()


def _halves(moments: torch.Tensor):
    return moments.chunk(2, dim=1)


def test_fp32_encode_is_diffusers_fp32_encode_to_rounding(layout):
    _, vae, size = layout
    video = _video(size, batch=2)
    ours = WanVAEEncoder(vae).encode(video)
    theirs = _diffusers(vae, video)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    for name, a, b in zip(("mean", "logvar"), _halves(ours), _halves(theirs)):
        # fp32 products summed in another order: a few ulps of the largest partial sums, nowhere near bf16's 2^-8
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-5 * max(scale, 1.0), name


def test_bf16_encode_is_within_the_allowance_of_diffusers_bf16_encode(layout):
    _, vae, size = layout
    video = _video(size)
    reference = _diffusers(vae, video)
    baseline = _diffusers(vae, video, torch.bfloat16)
    vae.to(torch.float32)
    ours = WanVAEEncoder(vae, precision="bf16").encode(video)
    assert ours.dtype == torch.float32  # the moments in the VAE's dtype, computed in bf16
    for name, a, r, b in zip(("mean", "logvar"), _halves(ours), _halves(reference), _halves(baseline)):
        report = compare_to_reference(name, a, r, b)
        assert report.ok, str(report)


def test_a_bf16_vae_encodes_in_bf16_by_default(layout):
    _, vae, size = layout
    video = _video(size, frames=5)
    try:
        vae.to(torch.bfloat16)
        encoder = WanVAEEncoder(vae)
        ours = encoder.encode(video.to(torch.bfloat16))
        assert encoder.dtype == torch.bfloat16 and ours.dtype == torch.bfloat16
    finally:
        vae.to(torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_plan_gives_the_same_moments_bit_for_bit(layout, precision):
    _, vae, size = layout
    video = _video(size, frames=13, batch=2)
    with torch_threads(1):
        base = WanVAEEncoder(vae, precision=precision, frames_per_pass=1, reuse_steady=False).encode(video)
        height = base.shape[3]
        plans = [dict(frames_per_pass=f) for f in (2, 3, 4, 8, "auto")]
        plans += [dict(frames_per_pass=1, tile_rows=r) for r in (1, 2, height - 1)]
        plans += [dict(frames_per_pass=2, tile_rows=2)]
        for plan in plans:
            got = WanVAEEncoder(vae, precision=precision, **plan).encode(video)
            assert torch.equal(got, base), plan
        samples = [WanVAEEncoder(vae, precision=precision).encode(video[b:b + 1]) for b in range(2)]
        assert torch.equal(torch.cat(samples), base)


def _image_to_video(size, frames: int = 29) -> torch.Tensor:
    """Image-to-video's conditioning input: an image, then zero frames."""
    video = torch.zeros((1, 3, frames, *size))
    video[:, :, :1] = _video(size, frames=1)
    return video


@pytest.mark.slow
def test_steady_reuse_is_exact_and_recorded_level_by_level(layout):
    _, vae, size = layout
    video = _image_to_video(size)
    with torch_threads(1):
        reusing = WanVAEEncoder(vae, frames_per_pass=1)
        on = reusing.encode(video)
        off = WanVAEEncoder(vae, frames_per_pass=1, reuse_steady=False).encode(video)
        tiled = WanVAEEncoder(vae, frames_per_pass=1, tile_rows=2)
        on_tiled = tiled.encode(video)
    assert torch.equal(on, off) and torch.equal(on_tiled, off)
    reused = reusing.last_reuse
    # Each level settles after the image has left its causal window, deeper levels later (pass indices from 0: the
    # first frame is pass 0); the head keeps reading the image through the levels' histories here.
    assert reused["level0"] == tuple(range(5, 8)) and reused["level1"] == (7,)
    assert reused["level2"] == () and reused["head"] == ()
    assert tiled.last_reuse["level0"] == reused["level0"]
    # "auto" takes one latent frame per pass where every frame after the first is the same (else the most that fit).
    with torch_threads(1):
        auto = WanVAEEncoder(vae)
        assert torch.equal(auto.encode(video), off)
    assert auto.last_plan.frames_per_pass == 1 and auto.last_reuse == reused
    auto.encode(_video(size, frames=29))
    assert auto.last_plan.frames_per_pass > 1


def test_a_late_frame_stops_the_reuse_and_a_moving_video_never_reuses(layout):
    _, vae, size = layout
    video = _image_to_video(size)
    video[:, :, 21] = 0.5  # pass 6's frames (17..20 are pass 5's)
    with torch_threads(1):
        encoder = WanVAEEncoder(vae, frames_per_pass=1)
        on = encoder.encode(video)
        off = WanVAEEncoder(vae, frames_per_pass=1, reuse_steady=False).encode(video)
        assert torch.equal(on, off)
        assert encoder.last_reuse["level0"] == (5,)
        encoder.encode(_video(size, frames=21))
        assert all(passes == () for passes in encoder.last_reuse.values())
        zeros = torch.zeros((1, 3, 21, *size))  # VACE's all-zero video: every level settles
        assert torch.equal(encoder.encode(zeros), WanVAEEncoder(vae, reuse_steady=False).encode(zeros))
        assert encoder.last_reuse["level0"]


def test_the_tile_margins_are_the_tightest_that_hold(layout, monkeypatch):
    """One latent row less of margin above or below an inner tile changes its moments; the margins as they are do
    not (the test above). Injected from here: a tile whose conv_in margin is 8 patchified rows (a latent row)
    shorter."""
    name, vae, _ = layout
    video = _video(TALL[name], frames=5)
    with torch_threads(1):
        base = WanVAEEncoder(vae, frames_per_pass=1).encode(video)
        assert torch.equal(WanVAEEncoder(vae, frames_per_pass=1, tile_rows=4).encode(video), base)
    for side in (0, 1):
        class Short(encoder_network.EncodeTile):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                margins = list(self.margins)
                edge = list(margins[-1])
                edge[side] -= self.scale
                margins[-1] = tuple(edge)
                self.margins = margins

        monkeypatch.setattr(passes, "EncodeTile", Short)
        with torch_threads(1):
            short = WanVAEEncoder(vae, frames_per_pass=1, tile_rows=4).encode(video)
        assert not torch.equal(short, base), f"side {side}"
        assert torch.isfinite(short).all()


def test_a_tile_encoded_whole_is_not_exact_which_is_why_tiles_have_two_phases(layout):
    """Its attention sees only the tile: however wide its margins, its rows differ from the whole frame's."""
    name, vae, size = layout
    video = _video(size, frames=5)
    encoder = WanVAEEncoder(vae, frames_per_pass=1)
    whole = encoder.encode(video)
    s = encoder.config.spatial_scale
    crop = encoder.encode(video[..., : s * (whole.shape[3] - 1), :])  # the frame without its last latent row
    rows = crop.shape[3]
    assert (crop - whole[..., :rows, :]).abs().max().item() > 1e-4


def test_frames_past_4k_plus_1_are_dropped_with_a_warning(layout, caplog):
    _, vae, size = layout
    video = _video(size, frames=8)
    encoder = WanVAEEncoder(vae)
    with caplog.at_level(logging.WARNING):
        got = encoder.encode(video)
    assert "frames 5..7 of 8 are dropped" in caplog.text
    assert got.shape[2] == 2
    assert torch.equal(got, encoder.encode(video[:, :, :5]))
    video[:, :, 6] = float("nan")  # a frame that is dropped is not read
    assert torch.equal(encoder.encode(video), got)


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [False, True])
def test_the_planner_replays_the_encode_it_plans(layout, reuse):
    """The replayed peak (the meta device, dry ops) against the storages the real encode allocates; with the steady
    reuse on an image-to-video input, whose settled stages hold their last input and output (the replay holds them
    for every stage: at most a few percent more)."""
    name, vae, _ = layout
    size = TALL[name]
    video = _image_to_video(size, frames=13) if reuse else _video(size, frames=13)
    for plan in (dict(frames_per_pass=1), dict(frames_per_pass=4), dict(frames_per_pass=1, tile_rows=2)):
        encoder = WanVAEEncoder(vae, reuse_steady=reuse, **plan)
        moments_shape = (1, 2 * encoder.config.z_dim, 4, *(n // encoder.config.spatial_scale for n in size))
        planned = encoder._planner(video.shape).peak_bytes(moments_shape, plan["frames_per_pass"],
                                                           plan.get("tile_rows"))
        with LiveBytes() as tracker:
            out = encoder.encode(video)
        working = tracker.peak - out.numel() * out.element_size()  # the returned moments are not working memory
        assert -0.02 * working <= planned - working <= (0.05 if reuse else 0.02) * working, plan


@pytest.mark.slow
def test_a_budget_picks_tiles_and_an_out_of_memory_encode_retries_smaller(layout, monkeypatch):
    name, vae, _ = layout
    video = _video(TALL[name], frames=9)
    with torch_threads(1):
        base = WanVAEEncoder(vae, frames_per_pass=1).encode(video)
        encoder = WanVAEEncoder(vae, frames_per_pass=1)
        untiled = encoder._planner(video.shape).peak_bytes((1, *base.shape[1:]), 1, None)
        budgeted = WanVAEEncoder(vae, frames_per_pass=1, max_memory=int(untiled * 1.05))
        assert budgeted.plan(video.shape).tile_rows is not None
        assert torch.equal(budgeted.encode(video), base)

        calls = {"n": 0}

        def conv3d_out_of_memory_once(x, w, b, out, residual=None):
            calls["n"] += 1
            if calls["n"] == 40:
                raise torch.OutOfMemoryError("injected: out of memory")
            TORCH_OPS.conv3d(x, w, b, out, residual)

        failing = dataclasses.replace(TORCH_OPS, conv3d=conv3d_out_of_memory_once)
        retrying = WanVAEEncoder(vae, frames_per_pass=2, backend=failing)
        assert torch.equal(retrying.encode(video), base)
        assert [p.frames_per_pass for p in retrying.last_retries] == [2]
        assert retrying.last_plan.frames_per_pass == 1
        # Later encodes of this shape start at the plan the retry chose.
        assert retrying.plan(video.shape).frames_per_pass == 1
        retrying.encode(video)
        assert retrying.last_retries == () and retrying.last_plan.frames_per_pass == 1

        def always_out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("injected: out of memory")

        never = WanVAEEncoder(vae, frames_per_pass=1,
                              backend=dataclasses.replace(TORCH_OPS, conv3d=always_out_of_memory))
        with pytest.raises(EncodeOutOfMemoryError, match="at every plan it tried"):
            never.encode(video)


def test_the_encoder_follows_the_vaes_weights(layout):
    _, vae, size = layout
    video = _video(size, frames=5)
    encoder = WanVAEEncoder(vae)
    before = encoder.encode(video)
    saved = vae.encoder.conv_in.weight.detach().clone()
    try:
        with torch.no_grad():
            vae.encoder.conv_in.weight.data.mul_(1.5)  # a write no version counter records
        after = encoder.encode(video)
        assert not torch.equal(after, before)
        theirs = _diffusers(vae, video)
        assert (after - theirs).abs().max().item() <= 2e-5 * max(theirs.abs().max().item(), 1.0)
    finally:
        with torch.no_grad():
            vae.encoder.conv_in.weight.copy_(saved)


@pytest.mark.parametrize("ci, co, factor_t, factor_s, frames", [
    (8, 16, 1, 2, 2),  # Wan2.2's level 0: groups of 2 folded channels (the columns of a pair)
    (8, 16, 2, 2, 4),  # its level 1: groups of 4 (rows and columns)
    (16, 16, 2, 2, 1),  # its level 2 on a 1-frame pass (a zero frame in front): groups of 8
    (16, 16, 1, 1, 3),  # its last level: the block's input itself
    (16, 8, 2, 2, 2),  # a narrowing shortcut: 2 whole input channels per group
    (12, 8, 2, 2, 2),  # groups of 12 folded channels, no whole dims: the refolded copy
])
def test_avg_down_add_adds_diffusers_avgdown3d(ci, co, factor_t, factor_s, frames):
    from diffusers.models.autoencoders.autoencoder_kl_wan import AvgDown3D

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, frames, 4, 6, ci, generator=g)  # [N, T, H, W, C], as the ops take activations
    base = torch.randn(1, -(-frames // factor_t), 4 // factor_s, 6 // factor_s, co, generator=g)
    out = base.clone()
    TORCH_OPS.avg_down_add(x, out, factor_t, factor_s)
    theirs = AvgDown3D(ci, co, factor_t, factor_s)(x.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(out, base + theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_fp32_encodes_first_pass_runs_each_causal_conv_with_its_last_tap_alone(layout, precision):
    """The first frame meets the causal zeros through every tap of a causal conv but the last: an fp32 encode's first
    pass runs each causal 3x3 conv on that frame with the last tap alone (a third of the work), the later passes and
    a bf16 encode (the compiled tables' kernels) with whole kernels; an image's moments are diffusers' to rounding,
    the same in inference mode."""
    _, vae, size = layout
    calls = []  # (input frames, taps) of each causal 3x3 conv, weights [Co, kt, kh, kw, Ci]

    def conv3d(x, w, b, out, residual=None):
        if tuple(w.shape[2:4]) == (3, 3):
            calls.append((x.shape[1], w.shape[1]))
        TORCH_OPS.conv3d(x, w, b, out, residual)

    encoder = WanVAEEncoder(vae, precision=precision, frames_per_pass=1, reuse_steady=False,
                            backend=dataclasses.replace(TORCH_OPS, conv3d=conv3d))
    encoder.encode(_video(size, frames=5))  # two passes: the first frame, then 4 frames
    whole = [call for call in calls if call[1] == 3]
    last_tap = [call for call in calls if call[1] == 1]
    assert whole and len(whole) + len(last_tap) == len(calls)
    if precision == "fp32":
        assert last_tap == [(1, 1)] * len(whole) and calls[:len(whole)] == last_tap
        image = _video(size, frames=1)  # an image's encode: that first pass alone
        with torch.no_grad():
            plain = encoder.encode(image)
        with torch.inference_mode():  # as FastVideo's stages call it: the same convs, the same moments
            assert torch.equal(encoder.encode(image), plain)
        theirs = _diffusers(vae, image)
        assert (plain - theirs).abs().max().item() <= 2e-5 * max(theirs.abs().max().item(), 1.0)
    else:
        assert not last_tap


@pytest.mark.parametrize("video, message", [
    ("not a tensor", "must be a torch.Tensor"),
    (torch.zeros(1, 3, 5, 64), "[B, 3, F, H, W]"),
    (torch.zeros(1, 4, 5, 64, 64), "[B, 3, F, H, W]"),
    (torch.zeros(1, 3, 5, 64, 64, dtype=torch.int64), "floating"),
    (torch.full((1, 3, 5, 64, 64), float("nan")), "NaN"),
])
def test_bad_videos_are_one_line_value_errors(layout, video, message):
    _, vae, _ = layout
    with pytest.raises(ValueError, match=None) as caught:
        WanVAEEncoder(vae).encode(video)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_wan22_sizes_must_be_multiples_of_16():
    vae = LAYOUTS["wan22"][0]()
    with pytest.raises(ValueError, match="16"):
        WanVAEEncoder(vae).encode(torch.zeros(1, 3, 5, 72, 64))


def test_fp32_means_fp32_after_a_caller_set_tf32_through_torchs_newer_settings(layout):
    """torch refuses to read the `allow_tf32` flags once a program set TF32 through the per-backend `fp32_precision`
    settings; the encode (and every `exact_fp32` block) then uses those settings, and restores them."""
    _, vae, size = layout
    video = _video(size, frames=5)
    expected = WanVAEEncoder(vae, precision="fp32").encode(video)
    conv, rnn = torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision
    try:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = "tf32", "ieee"
        with pytest.raises(RuntimeError):
            torch.backends.cudnn.allow_tf32  # noqa: B018 - torch's refusal, the case this covers
        assert torch.equal(WanVAEEncoder(vae, precision="fp32").encode(video), expected)
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = conv, rnn


@pytest.mark.parametrize("options, message", [
    (dict(precision="fp16"), "precision must be one of"),
    (dict(reuse_steady="yes"), "reuse_steady must be True or False"),
    (dict(conv_algorithm="winograd"), "unknown encoder option"),
    (dict(frames_per_pass=0), "frames_per_pass must be"),
    (dict(tile_rows=2, max_memory="1GiB"), "not both"),
])
def test_bad_options_are_refused_when_the_encoder_is_made(options, message):
    vae = LAYOUTS["wan21"][0]()
    with pytest.raises(ValueError, match=message):
        WanVAEEncoder(vae, **options)


def test_the_compiled_backend_needs_a_gpu_one_line_each():
    vae = LAYOUTS["wan21"][0]()
    for precision in ("auto", "bf16"):
        with pytest.raises(ValueError, match="^backend='cuda' needs a CUDA device; got device cpu") as caught:
            WanVAEEncoder(vae, device="cpu", backend="cuda", precision=precision)
        assert "\n" not in str(caught.value)


def test_a_bf16_encode_runs_the_compiled_tables_kernels_exactly_across_plans_and_counts_what_runs_portable(layout):
    """The compiled table (its CPU stand-in, `gpu_check.emulated_extension`: the binding's functions and rounding points
    in torch) serves the encoder's stride-1 convs and norms in bf16, within the allowance of diffusers' bf16 encode
    against its fp32 one; its plans give the same moments bit for bit; what the kernels never take (conv_in's 3 or 12
    input channels, the stride-2 convs, patchify) runs portable and is counted, and nothing else is."""
    _, vae, size = layout
    ext = EmulatedExtension()
    table = make_ops(ext)
    video = _video(size)
    reference, baseline = _diffusers(vae, video), _diffusers(vae, video, torch.bfloat16)
    vae.to(torch.float32)
    with torch_threads(1):
        ours = WanVAEEncoder(vae, precision="bf16", backend=table, frames_per_pass=1).encode(video)
        for plan in (dict(frames_per_pass=2), dict(frames_per_pass=1, tile_rows=1)):
            assert torch.equal(WanVAEEncoder(vae, precision="bf16", backend=table, **plan).encode(video), ours), plan
    for half, a, r, b in zip(("mean", "logvar"), _halves(ours), _halves(reference), _halves(baseline)):
        report = compare_to_reference(half, a, r, b)
        assert report.ok, str(report)
    assert {kind for kind, _ in ext.calls} == {"conv3d", "rms_norm_silu"}
    channels = 3 * vae.config.patch_size ** 2 if vae.config.patch_size else 3
    assert set(table.fallbacks) == {f"conv3d: {channels} input channels, {BY_DESIGN}", f"conv3d_strided: {BY_DESIGN}",
                                    f"patchify_into: {BY_DESIGN}"}  # Wan2.1's patch of 1: a copy into conv_in's window
