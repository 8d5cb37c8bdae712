"""The compiled (CUDA/CUTLASS) op table of the decoder: building it for the running GPU, loading it, and the runtime
self-check that keeps an unverified build (sm_100a cannot be tested here) from ever producing a wrong video.

What the decoder calls:

    table = compiled.load_ops(device)    # an ops.Ops, or CompiledUnavailable (a RuntimeError) saying why not

(ops.select_ops does exactly this for backend "auto" / "cuda"). The table is ops.TORCH_OPS with conv3d,
rms_norm_silu and upsample2x_conv3x3 replaced by the extension's kernels, same signatures and layout rules.

`load_ops` builds (first use; minutes) or loads (cached; about a second) the extension for the device's architecture,
then runs `self_check` (each op on small problems, then a small whole decode, against the fp32 reference under the
allowance of DESIGN.md §4) in a child process, so a faulting kernel cannot poison the caller's CUDA context; a pass
is remembered beside the cached build for that GPU model, driver and torch. A build outside the allowance raises
`CompiledUnavailable`; "auto" callers catch it and use the portable path (`ops.select_ops`, or `load_ops_or_none`
with a warning), "cuda" callers let it propagate. Either way the verdict holds for the rest of the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import build, ops, weights

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "conv3d_cutlass.cu", "rms_norm_silu.cu", "upsample_subpixel.cu")
HEADERS = ("decode_kernels.h",)
EXTENSION_PREFIX = "wan22_vae_decode_"  # + arch: builds for two GPU kinds can live in one process
CUTLASS_DIR_ENV = "WAN22_CUTLASS_DIR"  # a CUTLASS source tree (include/, tools/util/include/) instead of the wheel's

# Compute capability -> the one architecture we build for it (arch-specific "a" targets: TMA/WGMMA, UMMA).
ARCH_FOR_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
CUTLASS_FAMILY = {"sm_90a": "WAN22_SM90", "sm_100a": "WAN22_SM100", "sm_103a": "WAN22_SM100"}


class CompiledUnavailable(RuntimeError):
    """The compiled backend cannot be used here (no GPU, unsupported GPU, no toolchain, failed build or self-check)."""


# --------------------------------------------------------------------------------------------------- the build


def cutlass_source_dir() -> Path:
    """The CUTLASS tree to compile against: $WAN22_CUTLASS_DIR, else the `nvidia-cutlass` wheel's copy."""
    configured = os.environ.get(CUTLASS_DIR_ENV)
    if configured:
        root = Path(configured)
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            raise CompiledUnavailable("CUTLASS headers not found: install `nvidia-cutlass` or set "
                                      f"${CUTLASS_DIR_ENV} to a CUTLASS source tree")
        root = Path(spec.origin).parent / "source"
    if not (root / "include" / "cutlass" / "version.h").is_file():
        raise CompiledUnavailable(f"{root} is not a CUTLASS source tree (no include/cutlass/version.h)")
    return root


def cutlass_version(root: Path) -> str:
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = []
    for field in ("MAJOR", "MINOR", "PATCH"):
        line = next(l for l in text.splitlines() if l.startswith(f"#define CUTLASS_{field} "))
        parts.append(line.split()[2])
    return ".".join(parts)


def extension_name(arch: str) -> str:
    return EXTENSION_PREFIX + arch


def extension_spec(arch: str) -> build.ExtensionSpec:
    """The decoder extension for one architecture (torch applies one arch list to every file: build one arch)."""
    if arch not in CUTLASS_FAMILY:
        raise ValueError(f"arch must be one of {sorted(CUTLASS_FAMILY)}; got {arch!r}")
    cutlass = cutlass_source_dir()
    includes = (str(cutlass / "include"), str(cutlass / "tools" / "util" / "include"), str(CSRC))
    # Hidden visibility: the template instantiations of two builds loaded into one process (one per GPU kind) would
    # otherwise bind to each other's copies (GCC's process-wide unique symbols; measured: the sm_100a module ran the
    # sm_90a module's code).
    cuda_flags = (
        "-O3", "-Xcompiler=-fvisibility=hidden",
        "-DNDEBUG",  # without it ptxas serializes wgmma (warning C7510)
        f"-D{CUTLASS_FAMILY[arch]}", f"-DWAN22_ARCH={arch[3:].rstrip('a')}",
        "--expt-relaxed-constexpr", "--expt-extended-lambda",
        # torch's defaults hide the half/bf16 operators CUTLASS relies on
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    )
    return build.ExtensionSpec(
        name=extension_name(arch),
        sources=tuple(str(CSRC / s) for s in SOURCES),
        depends=tuple(str(CSRC / h) for h in HEADERS),
        extra_cflags=("-O3", "-fvisibility=hidden"),
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=includes,
        cuda_archs=(arch,),
        key_extras=(("cutlass", cutlass_version(cutlass)),),
    )


def arch_for_device(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    arch = ARCH_FOR_CAPABILITY.get((major, minor))
    if arch is None:
        raise CompiledUnavailable(f"no compiled kernels for compute capability {major}.{minor} "
                                  f"(built for {sorted(ARCH_FOR_CAPABILITY)})")
    return arch


def build_extension(arch: str, root: str | os.PathLike | None = None):
    """Build (or load from the cache) the extension for `arch`; works without a GPU (compile and import only)."""
    if build.cuda_home() is None:
        raise CompiledUnavailable("no CUDA toolkit (nvcc) found: set CUDA_HOME")
    return build.load_extension(extension_spec(arch), root=root)


# --------------------------------------------------------------------------------------------------- the op table


def _tma_ok(t: torch.Tensor | None) -> bool:
    """The kernels' layout preconditions: bf16, unit channel stride, 16-byte aligned base and strides."""
    return t is None or (t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                         and all(s % 8 == 0 for s in t.stride()[:-1]))


class CompiledKernels:
    """The extension's kernels behind the op signatures of `ops.py` (channels-last bf16, destination passing, the
    current CUDA stream). A call the kernels do not cover (not bf16, a channel count the TMA alignment rules out)
    goes to the portable op, so the table is total."""

    def __init__(self, ext):
        self.ext = ext
        self.arch = ext.arch()
        self._bias4: dict[tuple, torch.Tensor] = {}

    def conv3d(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               residual: torch.Tensor | None = None) -> None:
        """out = conv(x, w) + b (+ residual): valid in time and rows, zero padding kw//2 in width (ops.conv3d)."""
        kw = w.shape[3]
        co = w.shape[0]
        if (w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[-1] % 8
                or kw % 2 == 0 or not _tma_ok(x)
                or (co % 8 == 0 and not (_tma_ok(out) and _tma_ok(residual)))):
            return ops.conv3d(x, w, b, out, residual)
        b = b if b.dtype == torch.float32 and b.is_contiguous() else b.float().contiguous()
        pad_lo, pad_hi = [0, 0, kw // 2], [0, 0, kw // 2]
        if co % 8 == 0:
            self.ext.conv3d(x, w.contiguous(), b, out, residual, pad_lo, pad_hi)
            return None
        # e.g. conv_out's 12 channels: compute 16 (zero filters), keep 12
        extra = 8 - co % 8
        wide = out.new_empty((*out.shape[:4], co + extra))
        self.ext.conv3d(x, F.pad(w, (0, 0) * 4 + (0, extra)).contiguous(), F.pad(b, (0, extra)), wide, None,
                        pad_lo, pad_hi)
        out.copy_(wide[..., :co] if residual is None else wide[..., :co] + residual)
        return None

    def rms_norm_silu(self, x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor, silu: bool = True) -> None:
        """out = silu?(x / max(||x||_C, 1e-12) * gamma), one fused pass (ops.rms_norm_silu)."""
        if x.shape[-1] % 8 or x.shape[-1] > 2048 or not (_tma_ok(x) and _tma_ok(out)):
            return ops.rms_norm_silu(x, gamma, out, silu)
        gamma = gamma if gamma.dtype == torch.float32 and gamma.is_contiguous() else gamma.float().contiguous()
        self.ext.rms_norm_silu(x, gamma.reshape(-1), out, silu, ops.RMS_EPS)
        return None

    def upsample2x_conv3x3(self, x: torch.Tensor, w_sub: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """ops.upsample2x_conv3x3: one CUTLASS 2x2 conv computing all four phases (4 x Co channels, bias in the
        epilogue) over x's valid rows, then one pass interleaving the phases into out."""
        m, hi, width, ci = x.shape
        co = w_sub.shape[2]
        if (w_sub.dtype != torch.bfloat16 or not x.is_contiguous() or ci % 8 or co % 8 or not _tma_ok(x)
                or not _tma_ok(out) or out.stride(-2) != co or out.stride(-3) != 2 * width * co):
            return ops.upsample2x_conv3x3(x, w_sub, b, out)
        if out.shape != (m, 2 * (hi - 2), 2 * width, co):
            raise ValueError(f"out must be [{m}, {2 * (hi - 2)}, {2 * width}, {co}] for x {list(x.shape)}; "
                             f"got {list(out.shape)}")
        y = x.new_empty((m, 1, hi - 1, width + 1, 4 * co))
        self.ext.conv3d(x.view(m, 1, hi, width, ci), w_sub.reshape(4 * co, 1, 2, 2, ci).contiguous(),
                        self._bias_per_phase(b), y, None, [0, 0, 1], [0, 0, 1])
        self.ext.subpixel_scatter(y.view(m, hi - 1, width + 1, 4, co), out)
        return None

    def _bias_per_phase(self, b: torch.Tensor) -> torch.Tensor:
        key = (b.data_ptr(), b._version, b.numel())
        cached = self._bias4.get(key)
        if cached is None:
            if len(self._bias4) > 64:
                self._bias4.clear()
            cached = self._bias4[key] = b.float().repeat(4).contiguous()
        return cached


def make_ops(ext) -> ops.Ops:
    """The decoder's op table with the extension's kernels in place of the portable hot ops."""
    kernels = CompiledKernels(ext)
    return dataclasses.replace(ops.TORCH_OPS, name="compiled", conv3d=kernels.conv3d,
                               rms_norm_silu=kernels.rms_norm_silu, upsample2x_conv3x3=kernels.upsample2x_conv3x3)


# --------------------------------------------------------------------------------------------------- self-check


@dataclasses.dataclass(frozen=True)
class AllowanceReport:
    """DESIGN.md §4: d = candidate - reference; finite, max|d| <= 3 x baseline's, RMS(d) <= 3 x baseline's."""

    name: str
    max_err: float
    rms_err: float
    baseline_max_err: float
    baseline_rms_err: float
    finite: bool
    in_range: bool

    @property
    def ok(self) -> bool:
        return (self.finite and self.in_range and self.max_err <= 3 * self.baseline_max_err
                and self.rms_err <= 3 * self.baseline_rms_err)

    def __str__(self) -> str:
        return (f"{self.name}: max|d| {self.max_err:.3g} (allowed {3 * self.baseline_max_err:.3g}), "
                f"RMS(d) {self.rms_err:.3g} (allowed {3 * self.baseline_rms_err:.3g}), finite={self.finite}, "
                f"in_range={self.in_range} -> {'ok' if self.ok else 'OUTSIDE THE ALLOWANCE'}")


def compare_to_reference(name: str, candidate: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                         unit_range: bool = False) -> AllowanceReport:
    """The allowance rule, applied to any tensor (a video, with `unit_range`, or one op's output)."""
    if candidate.shape != reference.shape or baseline.shape != reference.shape:
        raise ValueError(f"{name}: shapes differ: candidate {list(candidate.shape)}, reference "
                         f"{list(reference.shape)}, baseline {list(baseline.shape)}")
    ref = reference.double()
    cand = candidate.double()
    base = baseline.double()
    finite = bool(torch.isfinite(cand).all())
    d = cand - ref
    db = base - ref
    return AllowanceReport(
        name=name,
        max_err=float(d.abs().max()) if finite else float("inf"),
        rms_err=float(d.pow(2).mean().sqrt()) if finite else float("inf"),
        baseline_max_err=float(db.abs().max()),
        baseline_rms_err=float(db.pow(2).mean().sqrt()),
        finite=finite,
        in_range=(not unit_range) or bool(cand.abs().max() <= 1.0),
    )


def reference_conv3d(x, w, b, residual=None):
    """ops.conv3d's definition in plain torch (NCDHW F.conv3d), computed in x's dtype."""
    y = F.conv3d(x.permute(0, 4, 1, 2, 3), w.permute(0, 4, 1, 2, 3).to(x.dtype), b.to(x.dtype),
                 padding=(0, 0, w.shape[3] // 2))
    y = y.permute(0, 2, 3, 4, 1)
    return y + residual if residual is not None else y


def reference_rms_norm_silu(x, gamma, silu=True):
    """Wan's RMS_norm (F.normalize * sqrt(C) * gamma; gamma here carries sqrt(C)) + SiLU, computed in x's dtype."""
    y = F.normalize(x, dim=-1, eps=ops.RMS_EPS) * gamma.to(x.dtype)
    return F.silu(y) if silu else y


def reference_upsample2x_conv3x3(x, w, b):
    """ops.upsample2x_conv3x3's definition from the original 3x3 weights w [Co, Ci, 3, 3]: nearest-2x upsample of
    x [M, Hi, W, C] (rows include one halo row each side), 3x3 conv valid in rows, zero-padded in width, then the
    rows that belong to the interior. Computed in x's dtype."""
    up = F.interpolate(x.permute(0, 3, 1, 2), scale_factor=2.0, mode="nearest")
    y = F.conv2d(up, w.to(x.dtype), b.to(x.dtype), padding=(0, 1))
    return y[:, :, 1:-1].permute(0, 2, 3, 1)


def _self_check_cases(device: torch.device, seed: int = 0) -> list[tuple[str, Callable, Callable]]:
    """Small problems covering every replaced op and the layouts the decoder uses: residuals, a 12-channel output
    (padded), outputs written into strided windows.

    Each case is (name, run(table) -> the table's output, reference(dtype) -> the definition computed in dtype)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    bf16 = torch.bfloat16

    def rand(*shape, scale=1.0):  # rounded to bf16 once, so every path sees the same inputs
        return (torch.randn(*shape, generator=g) * scale).to(bf16).to(device)

    cases = []
    for name, (co, kt, kh, kw, ci), with_residual, strided_out in [
        ("conv3d 3x3x3 + residual", (32, 3, 3, 3, 64), True, False),
        ("conv3d 3x3x3 into a strided window", (64, 3, 3, 3, 32), False, True),
        ("conv3d 1x1x1 + residual", (32, 1, 1, 1, 16), True, False),
        ("conv3d 3x1x1", (64, 3, 1, 1, 32), False, False),
        ("conv3d 3x3x3 to 12 channels", (12, 3, 3, 3, 32), False, False),
    ]:
        x = rand(2, kt + 2, kh + 5, 20, ci)
        w = rand(co, kt, kh, kw, ci, scale=(ci * kt * kh * kw) ** -0.5)
        b = rand(co, scale=0.1).float()
        out_shape = (2, 3, 6, 20, co)
        res = rand(*out_shape) if with_residual else None

        def run(table, x=x, w=w, b=b, res=res, out_shape=out_shape, strided_out=strided_out):
            if strided_out:  # frames of a bigger buffer (the decoder's causal windows)
                out = torch.zeros(out_shape[0], out_shape[1] + 2, *out_shape[2:], device=device, dtype=bf16)[:, 2:]
            else:
                out = torch.empty(out_shape, device=device, dtype=bf16)
            table.conv3d(x, w, b, out, res)
            return out

        def ref(dtype, x=x, w=w, b=b, res=res):
            return reference_conv3d(x.to(dtype), w.to(dtype), b, None if res is None else res.to(dtype))

        cases.append((name, run, ref))

    xn = rand(2, 3, 5, 7, 64, scale=3.0)
    gamma = ((1 + 0.1 * torch.randn(64, generator=g)) * 64 ** 0.5).to(device)

    def run_norm(table):  # written into the interior rows of a haloed window, as the decoder does
        window = torch.zeros(2, 5, 7, 7, 64, device=device, dtype=bf16)
        out = window[:, 2:, 1:-1]
        table.rms_norm_silu(xn, gamma, out)
        return out

    cases.append(("rms_norm_silu into a haloed window", run_norm,
                  lambda dtype: reference_rms_norm_silu(xn.to(dtype), gamma)))

    xu = rand(3, 6, 5, 32)  # 3 frames, 4 rows + 2 halo rows
    wu = rand(16, 32, 3, 3, scale=(9 * 32) ** -0.5)
    bu = rand(16, scale=0.1).float()
    w_sub = weights.subpixel_weights(wu.float())

    def run_up(table):
        out = torch.empty(3, 8, 10, 16, device=device, dtype=bf16)
        table.upsample2x_conv3x3(xu, w_sub, bu, out)
        return out

    cases.append(("upsample2x_conv3x3 (sub-pixel)", run_up,
                  lambda dtype: reference_upsample2x_conv3x3(xu.to(dtype), wu.to(dtype), bu)))
    return cases


def random_weights(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded decoder weights of a sensible scale for `reference.WanVAEConfig` config (every tensor the decoder
    reads): convs randn / sqrt(fan_in), biases 0.1 randn, RMS gammas 1 + 0.1 randn."""
    from fastvideo_pan2_ext import reference  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in reference.expected_shapes(config).items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("gamma"):
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = noise / math.prod(shape[1:]) ** 0.5
    return out


# A narrow Wan2.2-layout decoder (channels 8..32, 12 output channels) that decodes in well under a second.
SELF_CHECK_CONFIG = dict(z_dim=8, decoder_base_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                         temperal_upsample=(True, True, False), out_channels=12, patch_size=2)


def decode_check(table, device: torch.device, latent_shape=(1, 8, 2, 3, 4)) -> AllowanceReport:
    """Decode a small problem with `table` in the real decoder and judge the video against the fp32 reference decode
    under the allowance (baseline: the release bf16 decode)."""
    from fastvideo_pan2_ext import reference  # noqa: PLC0415
    from .decoder import WanVAEDecoder  # noqa: PLC0415 - the decoder imports ops, which imports this lazily

    weights_ = random_weights(reference.WanVAEConfig(**SELF_CHECK_CONFIG))
    z = torch.randn(latent_shape, generator=torch.Generator().manual_seed(7)).to(device)
    decoder = WanVAEDecoder(weights_, device=device, local=True, backend="torch", frames_per_pass=2)
    decoder.ops = table  # the same decoder, with the table under test in place of the portable one
    video = decoder.decode(z)
    return compare_to_reference(f"decode {list(latent_shape)}", video, reference.decode(z, weights_, torch.float32),
                                reference.decode(z, weights_, torch.bfloat16), unit_range=True)


def self_check(table, device: torch.device) -> list[AllowanceReport]:
    """Run `table` on small problems, each op alone and then a whole small decode, and compare each output with the
    fp32 reference under the allowance; the baseline is the same computation in bf16 (for a decode: the release bf16
    decode). Returns every report; the caller decides. Works for any op table (on CPU too)."""
    reports = []
    with _fp32_means_fp32():
        for name, run, ref in _self_check_cases(device):
            candidate = run(table)
            reference = ref(torch.float32)
            baseline = ref(torch.bfloat16)
            reports.append(compare_to_reference(name, candidate, reference, baseline))
        if all(r.ok for r in reports):  # a failed op already decides; the decode would only cost time
            reports.append(decode_check(table, device))
    return reports


class _fp32_means_fp32:
    """cuDNN/cuBLAS default to TF32 for fp32 in recent torch: the reference must be real fp32."""

    def __enter__(self):
        self.saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


# --------------------------------------------------------------------------------------------------- loading

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}  # (device, factory) -> op table or the CompiledUnavailable it raised


def judge(reports: list[AllowanceReport], what: str, device) -> None:
    """Raise CompiledUnavailable unless every report is within the allowance (the message lists every case)."""
    if not reports or not all(r.ok for r in reports):
        detail = "\n  ".join(str(r) for r in reports) or "no reports"
        raise CompiledUnavailable(f"{what} failed the runtime self-check on {device}:\n  {detail}")
    logger.info("%s passed the self-check on %s:\n  %s", what, device, "\n  ".join(map(str, reports)))


def verify_ops(table, device: torch.device) -> None:
    """Self-check `table` in this process; CompiledUnavailable when outside the allowance."""
    judge(self_check(table, device), f"op table {getattr(table, 'name', '?')}", device)


_CHILD_SELF_CHECK = """
import dataclasses, json, sys, torch
from fastvideo_pan2_ext.vae_kernel import compiled
device = torch.device(sys.argv[1])
torch.cuda.set_device(device)
table = compiled.make_ops(compiled.build_extension(sys.argv[2]))
reports = compiled.self_check(table, device)
torch.cuda.synchronize(device)
print("SELF_CHECK_JSON " + json.dumps([dataclasses.asdict(r) for r in reports]))
"""


def verify_build_isolated(ext, device: torch.device, timeout_s: float = 600) -> None:
    """Self-check the built extension on `device` in a child process, so that a kernel that faults (a sticky CUDA
    error poisons a process's context) cannot take the caller's CUDA context, and with it the portable fallback,
    down. A passing verdict is remembered beside the cached build for this GPU model, driver and torch, so later
    processes skip the child."""
    arch = ext.arch()
    props = torch.cuda.get_device_properties(device)
    verdict_key = hashlib.sha256(json.dumps([props.name, list(torch.cuda.get_device_capability(device)),
                                             torch.version.cuda, torch.__version__,
                                             _driver_version()]).encode()).hexdigest()[:16]
    verdict = Path(ext.__file__).parent / f"selfcheck-{verdict_key}.json"
    if verdict.is_file():
        try:
            reports = [AllowanceReport(**r) for r in json.loads(verdict.read_text())]
            judge(reports, f"compiled kernels ({arch}, remembered verdict)", device)
            return
        except (ValueError, TypeError, CompiledUnavailable):
            pass  # unreadable or failing: check again
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD_SELF_CHECK, str(device), arch], capture_output=True,
                              text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CompiledUnavailable(f"the self-check of the compiled kernels on {device} did not finish in "
                                  f"{timeout_s:.0f} s") from exc
    lines = [l for l in done.stdout.splitlines() if l.startswith("SELF_CHECK_JSON ")]
    if done.returncode != 0 or not lines:
        raise CompiledUnavailable(f"the self-check of the compiled kernels ({arch}) on {device} crashed "
                                  f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    reports = [AllowanceReport(**r) for r in json.loads(lines[-1][len("SELF_CHECK_JSON "):])]
    judge(reports, f"compiled kernels ({arch})", device)
    try:  # remember the pass (atomically); a read-only cache only means checking again next time
        tmp = verdict.with_name(f".{verdict.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([dataclasses.asdict(r) for r in reports]))
        os.replace(tmp, verdict)
    except OSError:
        pass


def _driver_version() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def load_ops(device: torch.device | str | int = "cuda", *, make_ops: Callable | None = None) -> ops.Ops:
    """The compiled op table for `device`: built or loaded from the cache, self-checked once per process (in a child
    process, see `verify_build_isolated`).

    Raises CompiledUnavailable (with the reason) when there is no usable CUDA GPU, the GPU's architecture has no
    kernels, the toolchain or CUTLASS is missing, the build fails, or the self-check fails. A failure is remembered
    for the process and device (the same exception again, without rebuilding).

    `make_ops(device) -> ops.Ops` replaces the build (a test hook: the table is then self-checked in this process
    with the same cases and the same judgement, and the failure memory is the same, e.g. for a deliberately wrong op
    table on CPU)."""
    device = torch.device(device)
    if make_ops is None:
        if device.type != "cuda":
            raise CompiledUnavailable(f"the compiled backend needs a CUDA device; got {device}")
        if not torch.cuda.is_available():
            raise CompiledUnavailable("the compiled backend needs a CUDA GPU; torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        make_ops = _build_ops
    with _lock:
        key = (str(device), make_ops)
        cached = _loaded.get(key)
        if isinstance(cached, CompiledUnavailable):
            raise cached
        if cached is not None:
            return cached
        try:
            table = make_ops(device)
            if make_ops is not _build_ops:
                verify_ops(table, device)
        except CompiledUnavailable as exc:
            _loaded[key] = exc
            logger.warning("compiled VAE decoder disabled for this process on %s: %s", device, exc)
            raise
        except Exception as exc:  # a build error, or a CUDA error inside the kernels
            wrapped = CompiledUnavailable(f"compiled backend unavailable on {device}: {type(exc).__name__}: {exc}")
            _loaded[key] = wrapped
            logger.warning("compiled VAE decoder disabled for this process on %s: %s", device, wrapped)
            raise wrapped from exc
        _loaded[key] = table
        return table


def _build_ops(device: torch.device) -> ops.Ops:
    with torch.cuda.device(device):
        ext = build_extension(arch_for_device(device))
        verify_build_isolated(ext, device)
        return make_ops(ext)


def load_ops_or_none(device: torch.device | str | int = "cuda", *, make_ops: Callable | None = None):
    """For backend="auto": the compiled ops, or None with a warning saying why the portable path is used."""
    try:
        return load_ops(device, make_ops=make_ops)
    except CompiledUnavailable as exc:
        warnings.warn(f"using the portable decoder: {exc}", RuntimeWarning, stacklevel=2)
        return None
