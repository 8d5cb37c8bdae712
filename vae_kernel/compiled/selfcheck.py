"""The runtime self-check of an op table: every op call the real decoders and encoders make, at their real channel
counts and a small spatial size, then one small whole decode and one small whole bf16 encode, each judged by the
allowance against the fp32 definition.

The cases are not listed by hand: `op_signatures` runs the decoder and the encoder of every supported architecture on
the meta device with a recording op table, so a new layer shape is covered the moment either uses it (the encoder's
160-, 320- and 640-channel convs, its attention's 1x1 convs, quant_conv...) (conv_in's 48 and 16
channels, conv_out's 12 and 3 outputs, the 1024-channel convs, the time convs' 2C outputs, the sub-pixel convs,
Wan2.1's halving ones...). Spatial sizes are chosen so that no GEMM dimension is a multiple of a kernel tile (rows 5,
width 13: M = 195 per 3 frames), and the decode check crosses pass boundaries (T = 4 at two frames per pass).

The op baseline is the definition computed in fp32 from the same bf16 inputs and rounded to bf16 once: the release
way for one op (bf16 tensors, fp32 accumulation); for the decode it is the release bf16 decode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from fastvideo_pan2_ext import reference

from ..portable import weights as weights_mod
from ..definitions.allowance import AllowanceReport, compare_to_reference
from ..definitions.architecture import (WAN21_CONFIG, WAN21_ENCODER_CONFIG, WAN22_CONFIG, WAN22_ENCODER_CONFIG,
                                        WanVAEConfig, expected_encoder_shapes, expected_shapes, narrow_encoder,
                                        video_shape)
from ..distributed.bands import LocalRows
from ..portable.encoder_network import EncodePass
from ..portable.network import CausalState, DecodePass
from ..portable.ops import RMS_EPS, TORCH_OPS, Ops
from ..portable.passes import DecodeRunner, EncodeRunner, collect
from ..definitions.precision import exact_fp32
from .kernels import BY_DESIGN, CHANNEL_MULTIPLE

SUPPORTED_CONFIGS = (WAN22_CONFIG, WAN21_CONFIG)  # the real decoders whose every op shape the self-check covers
SUPPORTED_ENCODER_CONFIGS = (WAN22_ENCODER_CONFIG, WAN21_ENCODER_CONFIG)  # and the real encoders

# A narrow Wan2.2-layout decoder with the real latent width (conv_in reads 48 channels) for the whole-decode check.
DECODE_CHECK_CONFIG = WanVAEConfig(z_dim=48, decoder_base_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                                   temperal_upsample=(True, True, False), out_channels=12, patch_size=2)
DECODE_CHECK_LATENTS = (1, 48, 4, 3, 5)  # T = 4 at 2 frames per pass: passes [0,1) [1,3) [3,4)
CASE_FRAMES, CASE_ROWS, CASE_WIDTH = 3, 5, 13
# A narrow Wan2.2-layout encoder (patchify: conv_in reads 12 channels; the real 48 latent channels) for the whole
# encode check: 9 frames at 1 latent frame per pass cross passes and both temporal downsamples.
ENCODE_CHECK_CONFIG = narrow_encoder(WAN22_ENCODER_CONFIG, base_dim=16)
ENCODE_CHECK_VIDEO = (1, 3, 9, 32, 48)


# --------------------------------------------------------------------------------------------------- definitions


def reference_conv3d(x, w, b, residual=None):
    """ops.conv3d's definition in plain torch (NCDHW F.conv3d), computed in x's dtype."""
    y = F.conv3d(x.permute(0, 4, 1, 2, 3), w.permute(0, 4, 1, 2, 3).to(x.dtype), b.to(x.dtype),
                 padding=(0, 0, w.shape[3] // 2))
    y = y.permute(0, 2, 3, 4, 1)
    return y + residual if residual is not None else y


def reference_rms_norm_silu(x, gamma, silu=True):
    """Wan's RMS_norm (F.normalize * sqrt(C) * gamma; gamma here carries sqrt(C)) + SiLU, computed in x's dtype."""
    y = F.normalize(x, dim=-1, eps=RMS_EPS) * gamma.to(x.dtype)
    return F.silu(y) if silu else y


def reference_upsample2x_conv3x3(x, w, b):
    """ops.upsample2x_conv3x3's definition from the original 3x3 weights w [Co, Ci, 3, 3]: nearest-2x upsample of
    x [M, Hi, W, C] (rows include one halo row each side), 3x3 conv valid in rows, zero-padded in width, then the
    rows that belong to the interior. Computed in x's dtype."""
    up = F.interpolate(x.permute(0, 3, 1, 2), scale_factor=2.0, mode="nearest")
    y = F.conv2d(up, w.to(x.dtype), b.to(x.dtype), padding=(0, 1))
    return y[:, :, 1:-1].permute(0, 2, 3, 1)


def random_weights(config: WanVAEConfig, seed: int = 0, scale: float = 1.0,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded fp32 decoder weights of a sensible scale for `config` (every tensor the decoder reads), like a trained
    model's initialisation: convs randn / sqrt(fan_in) (times `scale`, to stress the arithmetic), biases 0.1 randn,
    RMS gammas 1 + 0.1 randn. Drawn on `device` (the same seed gives the same weights on the same kind of device)."""
    g = torch.Generator(device).manual_seed(seed)
    return {name: seeded_parameter(name, shape, g, scale) for name, shape in expected_shapes(config).items()}


def seeded_parameter(name: str, shape, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """The seeded-weight rule (the self-check's weights, and every test's and benchmark's random-weight model): fp32
    noise from `generator` (on its device) scaled by what the parameter `name` is: an RMS gamma 1 + 0.1 randn, a bias
    0.1 randn, a conv weight [out, in, *kernel] randn / sqrt(fan_in) times `scale` (activations stay O(1))."""
    noise = torch.randn(tuple(shape), generator=generator, device=generator.device)
    if name.endswith("gamma"):
        return 1.0 + 0.1 * noise
    if name.endswith("bias"):
        return 0.1 * noise
    return noise * (scale / math.prod(shape[1:]) ** 0.5)


# --------------------------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True, order=True)
class Signature:
    """One kind of op call the decoder makes: the op, its channel counts and kernel, and its layout."""

    op: str
    ci: int
    co: int
    kernel: tuple[int, int, int] = (1, 1, 1)
    residual: bool = False
    silu: bool = True
    strided_out: bool = False

    def __str__(self) -> str:
        extras = [f"k{'x'.join(map(str, self.kernel))}"] if self.op != "rms_norm_silu" else ([] if self.silu else
                                                                                               ["no silu"])
        extras += ["+ residual"] * self.residual + ["into a strided window"] * self.strided_out
        return f"{self.op} {self.ci} -> {self.co} {' '.join(extras)}".strip()


def op_signatures(configs=None, encoder_configs=None) -> set[Signature]:
    """Every distinct op call the decoders of `configs` and the bf16 encoders of `encoder_configs` make (the first
    pass and a later one), recorded from a run on the meta device. Defaults: `SUPPORTED_CONFIGS` and, with them,
    `SUPPORTED_ENCODER_CONFIGS` (with `configs` given: no encoder unless named)."""
    seen: set[Signature] = set()

    def conv3d(x, w, b, out, residual=None):
        seen.add(Signature("conv3d", w.shape[4], w.shape[0], tuple(w.shape[1:4]), residual is not None,
                           strided_out=not out.is_contiguous()))

    def rms_norm_silu(x, gamma, out, silu=True):
        seen.add(Signature("rms_norm_silu", x.shape[-1], x.shape[-1], silu=silu, strided_out=not out.is_contiguous()))

    def upsample2x_conv3x3(x, w_sub, b, out):
        seen.add(Signature("upsample2x_conv3x3", x.shape[-1], w_sub.shape[2], (1, 3, 3)))

    def ignore(*args, **kwargs):
        pass

    recorder = Ops("recorder", conv3d, rms_norm_silu, upsample2x_conv3x3, ignore, ignore, ignore, ignore, ignore,
                   ignore)
    meta = torch.device("meta")
    if encoder_configs is None:
        encoder_configs = SUPPORTED_ENCODER_CONFIGS if configs is None else ()
    for config in configs or SUPPORTED_CONFIGS:
        weights = {name: weights_mod.prepare(name, torch.empty(shape, device=meta))
                   for name, shape in expected_shapes(config).items()}
        state = CausalState(meta)
        for first, frames in ((True, 1), (False, 2)):
            z = torch.empty((config.z_dim, frames, 2, 2), device=meta)
            DecodePass(recorder, weights, config, LocalRows(2), state, first).run(z)
    for config in encoder_configs:
        weights = {name: weights_mod.prepare_encoder(name, torch.empty(shape, device=meta), torch.bfloat16)
                   for name, shape in expected_encoder_shapes(config).items()}
        state = CausalState(meta)
        side = 2 * config.spatial_scale
        for first, frames in ((True, 1), (False, 4)):
            step = EncodePass(recorder, weights, config, LocalRows(2), state, first)
            step.phase2(step.phase1(torch.empty((1, 3, frames, side, side), device=meta)))
    return seen


Case = tuple[str, Callable[[Ops], torch.Tensor], Callable[[], torch.Tensor]]


def _case(sig: Signature, device: torch.device, g: torch.Generator) -> Case:
    """(name, run(table) -> the table's output, reference() -> the definition in fp32) for one signature."""
    bf16 = torch.bfloat16

    def rand(*shape, scale=1.0):  # rounded to bf16 once, so every path sees the same inputs
        return (torch.randn(*shape, generator=g) * scale).to(bf16).to(device)

    f, r, w_ = CASE_FRAMES, CASE_ROWS, CASE_WIDTH
    if sig.op == "conv3d":
        kt, kh, kw = sig.kernel
        x = rand(1, f + kt - 1, r + kh - 1, w_, sig.ci)
        w = rand(sig.co, kt, kh, kw, sig.ci, scale=(sig.ci * kt * kh * kw) ** -0.5)
        b = rand(sig.co, scale=0.1).float()
        res = rand(1, f, r, w_, sig.co) if sig.residual else None

        def run(table):
            out = (torch.zeros(1, f + 2, r, w_, sig.co, device=device, dtype=bf16)[:, 2:] if sig.strided_out
                   else torch.empty(1, f, r, w_, sig.co, device=device, dtype=bf16))
            table.conv3d(x, w, b, out, res)
            return out

        return str(sig), run, lambda: reference_conv3d(x.float(), w.float(), b, None if res is None else res.float())
    if sig.op == "rms_norm_silu":
        x = rand(1, f, r, w_, sig.ci, scale=3.0)
        gamma = ((1 + 0.1 * torch.randn(sig.ci, generator=g)) * sig.ci ** 0.5).to(device)

        def run(table):  # strided: into the interior rows of a haloed window, as the decoder writes it
            out = (torch.zeros(1, f + 2, r + 2, w_, sig.ci, device=device, dtype=bf16)[:, 2:, 1:-1]
                   if sig.strided_out else torch.empty(1, f, r, w_, sig.ci, device=device, dtype=bf16))
            table.rms_norm_silu(x, gamma, out, sig.silu)
            return out

        return str(sig), run, lambda: reference_rms_norm_silu(x.float(), gamma, sig.silu)
    if sig.op == "upsample2x_conv3x3":
        x = rand(f, r + 2, w_, sig.ci)
        w3 = rand(sig.co, sig.ci, 3, 3, scale=(9 * sig.ci) ** -0.5)
        b = rand(sig.co, scale=0.1).float()
        w_sub = weights_mod.subpixel_weights(w3.float())

        def run(table):
            out = torch.empty(f, 2 * r, 2 * w_, sig.co, device=device, dtype=bf16)
            table.upsample2x_conv3x3(x, w_sub, b, out)
            return out

        return str(sig), run, lambda: reference_upsample2x_conv3x3(x.float(), w3.float(), b)
    raise ValueError(f"no self-check case for op {sig.op!r}")


# --------------------------------------------------------------------------------------------------- the check


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One case's allowance report, and the calls of it the table handed to the portable op (op: reason -> count).
    A case that fell back failed, whatever its numbers: it checked the portable op, not the kernels, and a decoder
    running on portable ops must not pass as compiled."""

    report: AllowanceReport
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.fallbacks

    def to_json(self) -> dict:
        return {"report": dataclasses.asdict(self.report), "fallbacks": self.fallbacks}

    @classmethod
    def from_json(cls, data: dict) -> "CaseResult":
        return cls(AllowanceReport(**data["report"]), dict(data["fallbacks"]))

    def __str__(self) -> str:
        fell = f"; FAILED: fell back to the portable op: {self.fallbacks}" if self.fallbacks else ""
        return f"{self.report}{fell}"


def _counted(table: Ops, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict[str, int]]:
    before = dict(table.fallbacks)
    out = run()
    return out, {k: v - before.get(k, 0) for k, v in table.fallbacks.items() if v != before.get(k, 0)}


def decode_check(table: Ops, device: torch.device) -> CaseResult:
    """A small whole decode with `table` through the real decode loops, judged against the fp32 reference decode
    (baseline: the release bf16 decode)."""
    state_dict = random_weights(DECODE_CHECK_CONFIG)
    config, prepared = weights_mod.load(state_dict, device, table.cpu_compute_layout)
    z = torch.randn(DECODE_CHECK_LATENTS, generator=torch.Generator().manual_seed(7)).to(device)
    runner = DecodeRunner(table, prepared, config, device, frames_per_pass=2)
    video, fallbacks = _counted(table, lambda: collect(runner.iter_bands(z, LocalRows(z.shape[3])),
                                                       video_shape(config, z.shape), device))
    report = compare_to_reference(f"decode {list(DECODE_CHECK_LATENTS)} at 2 frames per pass", video,
                                  reference.decode(z, state_dict, torch.float32),
                                  reference.decode(z, state_dict, torch.bfloat16), unit_range=True)
    return CaseResult(report, fallbacks)


@functools.cache
def coverage() -> str:
    """What `self_check` checks by default, as text: every signature and the whole decode's and encode's settings (a
    remembered verdict is keyed by it: `verification.verdict_path`)."""
    return "; ".join([*sorted(map(str, op_signatures())), f"decode {DECODE_CHECK_CONFIG} {DECODE_CHECK_LATENTS}",
                      f"encode {ENCODE_CHECK_CONFIG} {ENCODE_CHECK_VIDEO}"])


def encode_check(table: Ops, device: torch.device) -> CaseResult:
    """A small whole bf16 encode with `table` through the real encode loop, judged against the fp32 reference encode
    (baseline: the bf16 reference encode). The calls the kernels were never meant to take (`kernels.BY_DESIGN`:
    conv_in's 12 channels, the stride-2 convs, patchify) are not failures; any other fallback is."""
    config = ENCODE_CHECK_CONFIG
    g = torch.Generator().manual_seed(11)
    state_dict = {name: seeded_parameter(name, shape, g) for name, shape in expected_encoder_shapes(config).items()}
    part = weights_mod.encoder_part(torch.bfloat16)
    prepared = weights_mod.PreparedWeights(state_dict, weights_mod.checked(state_dict, part), device,
                                           table.cpu_compute_layout, part).tensors
    video = (torch.rand(ENCODE_CHECK_VIDEO, generator=g) * 2 - 1).to(device)
    latent = (1, 2 * config.z_dim, 1 + (video.shape[2] - 1) // 4, video.shape[3] // config.spatial_scale,
              video.shape[4] // config.spatial_scale)
    runner = EncodeRunner(table, prepared, config, device, torch.bfloat16, 1, reuse_steady=False, progress=False)
    (moments, _), fallbacks = _counted(table, lambda: runner.encode(video, latent, None))
    report = compare_to_reference(f"encode {list(ENCODE_CHECK_VIDEO)} in bf16 at 1 latent frame per pass",
                                  moments.permute(0, 4, 1, 2, 3).float(),
                                  reference.encode(video, state_dict, torch.float32),
                                  reference.encode(video, state_dict, torch.bfloat16).float())
    return CaseResult(report, {k: n for k, n in fallbacks.items() if BY_DESIGN not in k})


def self_check(table: Ops, device: torch.device, configs=None, keep_going: bool = False,
               seed: int = 0, encoder_configs=None) -> list[CaseResult]:
    """Run every op the table replaces at every signature the decoders of `configs` and the encoders of
    `encoder_configs` use (defaults: `op_signatures`'), then (if all pass) a small whole decode, and a small whole
    encode where encoders were checked. Returns the results, up to the first failing case (every case with
    `keep_going`, for a full diagnosis); the caller judges. Works for any op table, on CPU too."""
    g = torch.Generator().manual_seed(seed)
    results = []
    if encoder_configs is None:
        encoder_configs = SUPPORTED_ENCODER_CONFIGS if configs is None else ()
    with torch.no_grad(), exact_fp32():
        for sig in sorted(op_signatures(configs, encoder_configs)):
            if getattr(table, sig.op) is getattr(TORCH_OPS, sig.op):
                continue  # the portable op itself: nothing compiled to check
            if sig.op == "conv3d" and sig.ci % CHANNEL_MULTIPLE:
                continue  # the encoder's conv_in (3 or 12 channels): portable by design, counted at each call
            name, run, ref = _case(sig, device, g)
            candidate, fallbacks = _counted(table, lambda: run(table))
            reference = ref()
            report = compare_to_reference(name, candidate, reference, reference.to(torch.bfloat16))
            results.append(CaseResult(report, fallbacks))
            if not results[-1].ok and not keep_going:
                break
        if all(r.ok for r in results):  # a failed op already decides; the decode would only cost time
            results.append(decode_check(table, device))
        if encoder_configs and all(r.ok for r in results):
            results.append(encode_check(table, device))
    return results
