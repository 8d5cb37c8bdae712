"""The compiled (CUDA/CUTLASS) op table of the decoder: building it for the running GPU, loading it, and the runtime
self-check that keeps an unverified build (sm_100a cannot be tested here) from ever producing a wrong video.

What the decoder calls:

    ops = compiled.load_ops(device)      # CompiledOps, or CompiledUnavailable (a RuntimeError) saying why not
    ops.conv3d(x, w, b, out, residual=None)
    ops.rms_norm_silu(x, gamma, out, silu=True)
    ops.upsample2x_conv3x3(x, w, b, out)

`load_ops` builds (first use; minutes) or loads (cached; about a second) the extension for the device's architecture,
then runs `self_check` once per process and device. A build whose results fall outside the allowance of DESIGN.md §4
raises `CompiledUnavailable`; "auto" callers catch it and use the portable path (`load_ops_or_none` does this with a
warning), "cuda" callers let it propagate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import build

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "conv3d_cutlass.cu", "rms_norm_silu.cu")
HEADERS = ("decode_kernels.h",)
EXTENSION_NAME = "wan22_vae_decode_ext"
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


def extension_spec(arch: str) -> build.ExtensionSpec:
    """The decoder extension for one architecture (torch applies one arch list to every file: build one arch)."""
    if arch not in CUTLASS_FAMILY:
        raise ValueError(f"arch must be one of {sorted(CUTLASS_FAMILY)}; got {arch!r}")
    cutlass = cutlass_source_dir()
    includes = (str(cutlass / "include"), str(cutlass / "tools" / "util" / "include"), str(CSRC))
    cuda_flags = (
        "-std=c++17", "-O3",
        "-DNDEBUG",  # without it ptxas serializes wgmma (warning C7510)
        f"-D{CUTLASS_FAMILY[arch]}", f'-DWAN22_ARCH_NAME="{arch}"',
        "--expt-relaxed-constexpr", "--expt-extended-lambda",
        # torch's defaults hide the half/bf16 operators CUTLASS relies on
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    )
    return build.ExtensionSpec(
        name=EXTENSION_NAME,
        sources=tuple(str(CSRC / s) for s in SOURCES),
        depends=tuple(str(CSRC / h) for h in HEADERS),
        extra_cflags=("-O3", "-std=c++17"),
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


def subpixel_weights(w: torch.Tensor) -> torch.Tensor:
    """Nearest-2x upsample then 3x3 conv == four 2x2 convs on the low-resolution input, one per output phase.

    w: [Co, 3, 3, Ci] (or [Co, 1, 3, 3, Ci]). Returns [2, 2, Co, 1, 2, 2, Ci] (row phase, column phase, filter): for
    output row 2i+a the upsampled rows 2i+a-1..2i+a+1 come from low-res rows {i-1, i} (a=0: taps 0 | 1+2) or
    {i, i+1} (a=1: taps 0+1 | 2); likewise for columns. Summed in fp32, rounded once to w's dtype.
    """
    if w.dim() == 5:
        if w.shape[1] != 1:
            raise ValueError(f"upsample conv weights must be [Co, 1, 3, 3, Ci]; got {list(w.shape)}")
        w = w[:, 0]
    if w.dim() != 4 or w.shape[1:3] != (3, 3):
        raise ValueError(f"upsample conv weights must be [Co, 3, 3, Ci]; got {list(w.shape)}")
    w32 = w.float()
    # fold[a] maps 3 taps to 2 for output phase a
    fold = w32.new_tensor([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]])  # [phase, new tap, old tap]
    phases = torch.einsum("aur,bvs,krsc->abkuvc", fold, fold, w32)
    return phases.unsqueeze(3).to(w.dtype).contiguous()


class CompiledOps:
    """The op table over the extension. Channels-last bf16 tensors, destination passing, current CUDA stream."""

    name = "compiled"

    def __init__(self, ext, device: torch.device):
        self.ext = ext
        self.device = device
        self.arch = ext.arch()
        self._subpixel_cache: dict[tuple, torch.Tensor] = {}

    def conv3d(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """out = conv(x, w) + b (+ residual): valid in time and rows, zero padding kw//2 in width."""
        kw = w.shape[3]
        if kw % 2 != 1:
            raise ValueError(f"conv3d width kernel must be odd; got w {list(w.shape)}")
        self._conv(x, w, b, out, residual, pad_lo=(0, 0, kw // 2), pad_hi=(0, 0, kw // 2))
        return out

    def rms_norm_silu(self, x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor, silu: bool = True) -> torch.Tensor:
        """out = silu?(x / max(||x||_C, 1e-12) * gamma); gamma already carries Wan's sqrt(C) scale."""
        if gamma.dtype != torch.float32 or not gamma.is_contiguous():
            gamma = gamma.float().contiguous()
        self.ext.rms_norm_silu(x, gamma.reshape(-1), out, silu, 1e-12)
        return out

    def upsample2x_conv3x3(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [N, T, 2H, 2W, Co] = conv3x3(nearest2x(x)) + b with zero padding 1, as four sub-pixel 2x2 convs that
        each write one phase of `out` through a strided view (no interleave pass)."""
        n, t, h, wd, _ = x.shape
        if out.shape[:4] != (n, t, 2 * h, 2 * wd):
            raise ValueError(f"out must be [{n}, {t}, {2 * h}, {2 * wd}, Co] for x {list(x.shape)}; "
                             f"got {list(out.shape)}")
        phases = self._subpixel(w)
        for a in (0, 1):
            for c in (0, 1):
                self._conv(x, phases[a, c], b, out[:, :, a::2, c::2, :], None,
                           pad_lo=(0, 1 - a, 1 - c), pad_hi=(0, a, c))
        return out

    # -- helpers

    def _subpixel(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
        cached = self._subpixel_cache.get(key)
        if cached is None:
            if len(self._subpixel_cache) > 64:
                self._subpixel_cache.clear()
            cached = self._subpixel_cache[key] = subpixel_weights(w)
        return cached

    def _conv(self, x, w, b, out, residual, pad_lo, pad_hi) -> None:
        if b.dtype != torch.float32 or not b.is_contiguous():
            b = b.float().contiguous()
        co, ci = w.shape[0], w.shape[-1]
        if ci % 8:  # TMA rows need 16-byte alignment: zero channels change nothing
            extra = 8 - ci % 8
            x = F.pad(x, (0, extra))
            w = F.pad(w, (0, extra))
        if co % 8:  # e.g. conv_out's 12 channels: compute 16, keep 12
            extra = 8 - co % 8
            wide = out.new_empty((*out.shape[:4], co + extra))
            self.ext.conv3d(x.contiguous(), F.pad(w, (0, 0) * 4 + (0, extra)).contiguous(), F.pad(b, (0, extra)),
                            wide, None, list(pad_lo), list(pad_hi))
            if residual is not None:
                out.copy_(wide[..., :co] + residual)
            else:
                out.copy_(wide[..., :co])
            return
        self.ext.conv3d(x.contiguous(), w.contiguous(), b, out, residual, list(pad_lo), list(pad_hi))


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


def reference_conv3d(x, w, b, residual=None, pad_w=None):
    """conv3d in torch on channels-last tensors, in x's dtype (fp32: the reference; bf16: the release baseline)."""
    kw = w.shape[3]
    pad_w = kw // 2 if pad_w is None else pad_w
    y = F.conv3d(x.permute(0, 4, 1, 2, 3), w.permute(0, 4, 1, 2, 3), b.to(x.dtype), padding=(0, 0, pad_w))
    y = y.permute(0, 2, 3, 4, 1)
    return y + residual if residual is not None else y


def reference_rms_norm_silu(x, gamma, silu=True):
    """Wan's RMS_norm (F.normalize * sqrt(C) * gamma; here gamma carries sqrt(C)) in fp32, cast back, then SiLU."""
    y = (F.normalize(x.float(), dim=-1) * gamma.float()).to(x.dtype)
    return F.silu(y) if silu else y


def reference_upsample2x_conv3x3(x, w, b):
    """nearest-2x upsample then a zero-padded 3x3 conv, per frame, in x's dtype."""
    n, t, h, wd, c = x.shape
    frames = x.reshape(n * t, h, wd, c).permute(0, 3, 1, 2)
    up = F.interpolate(frames, scale_factor=2.0, mode="nearest")
    w2 = (w[:, 0] if w.dim() == 5 else w).permute(0, 3, 1, 2)
    y = F.conv2d(up, w2.to(x.dtype), b.to(x.dtype), padding=1)
    return y.permute(0, 2, 3, 1).reshape(n, t, 2 * h, 2 * wd, -1)


def _self_check_cases(device: torch.device, seed: int = 0) -> list[tuple[str, Callable, Callable]]:
    """Small problems covering every op and shape family the decoder uses (incl. padded 12-channel output).

    Each case is (name, run(ops) -> candidate output, run_reference(dtype) -> reference output in that dtype)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    cases = []
    for name, (co, kt, kh, kw, ci), with_residual in [
        ("conv3d 3x3x3 + residual", (32, 3, 3, 3, 64), True),
        ("conv3d 3x3x3", (64, 3, 3, 3, 32), False),
        ("conv3d 1x1x1", (32, 1, 1, 1, 16), True),
        ("conv3d 3x1x1", (64, 3, 1, 1, 32), False),
        ("conv3d 3x3x3 to 12 channels", (12, 3, 3, 3, 32), False),
    ]:
        x = rand(1, kt + 2, kh + 5, 20, ci)
        w = rand(co, kt, kh, kw, ci, scale=(ci * kt * kh * kw) ** -0.5)
        b = rand(co, scale=0.1)
        res = rand(1, 3, 6, 20, co) if with_residual else None

        def run(ops, x=x, w=w, b=b, res=res):
            out = torch.empty(x.shape[0], x.shape[1] - w.shape[1] + 1, x.shape[2] - w.shape[2] + 1, x.shape[3],
                              w.shape[0], device=device, dtype=torch.bfloat16)
            bf = torch.bfloat16
            return ops.conv3d(x.to(bf), w.to(bf), b, out, None if res is None else res.to(bf))

        def ref(dtype, x=x, w=w, b=b, res=res):
            xb, wb = x.to(torch.bfloat16).to(dtype), w.to(torch.bfloat16).to(dtype)
            rb = None if res is None else res.to(torch.bfloat16).to(dtype)
            return reference_conv3d(xb, wb, b, rb)

        cases.append((name, run, ref))

    x = rand(2, 3, 5, 7, 64, scale=3.0)
    gamma = (1 + 0.1 * rand(64)) * 64 ** 0.5
    cases.append(("rms_norm_silu",
                  lambda ops: ops.rms_norm_silu(x.to(torch.bfloat16), gamma, torch.empty_like(x, dtype=torch.bfloat16)),
                  lambda dtype: reference_rms_norm_silu(x.to(torch.bfloat16).to(dtype), gamma)))

    xu = rand(1, 2, 5, 6, 32)
    wu = rand(16, 3, 3, 32, scale=(9 * 32) ** -0.5)
    bu = rand(16, scale=0.1)
    cases.append(("upsample2x_conv3x3",
                  lambda ops: ops.upsample2x_conv3x3(xu.to(torch.bfloat16), wu.to(torch.bfloat16), bu,
                                                     torch.empty(1, 2, 10, 12, 16, device=device,
                                                                 dtype=torch.bfloat16)),
                  lambda dtype: reference_upsample2x_conv3x3(xu.to(torch.bfloat16).to(dtype),
                                                             wu.to(torch.bfloat16).to(dtype), bu)))
    return cases


def self_check(ops, device: torch.device) -> list[AllowanceReport]:
    """Run `ops` on small problems and compare each output with the fp32 reference under the allowance, the baseline
    being the same torch computation in bf16 (what the release bf16 decode does per layer). Returns every report;
    the caller decides. Works for any op table with the compiled table's methods (on CPU too)."""
    reports = []
    with _fp32_means_fp32():
        for name, run, ref in _self_check_cases(device):
            candidate = run(ops)
            reference = ref(torch.float32)
            baseline = ref(torch.bfloat16)
            reports.append(compare_to_reference(name, candidate, reference, baseline))
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


def verify_ops(ops, device: torch.device) -> None:
    """Raise CompiledUnavailable when `ops` fails the self-check (the message lists every case)."""
    reports = self_check(ops, device)
    failed = [r for r in reports if not r.ok]
    if failed:
        detail = "\n  ".join(str(r) for r in reports)
        raise CompiledUnavailable(f"compiled kernels for {getattr(ops, 'arch', '?')} failed the runtime self-check "
                                  f"on {device}:\n  {detail}")
    logger.info("compiled kernels passed the self-check on %s:\n  %s", device, "\n  ".join(map(str, reports)))


def load_ops(device: torch.device | str | int = "cuda", *, make_ops: Callable | None = None) -> CompiledOps:
    """The compiled op table for `device`: built or loaded from the cache, self-checked once per process.

    Raises CompiledUnavailable (with the reason) when there is no usable CUDA GPU, the GPU's architecture has no
    kernels, the toolchain or CUTLASS is missing, the build fails, or the self-check fails. A failure is remembered
    for the process and device (the same exception again, without rebuilding).

    `make_ops(device) -> op table` replaces the build (a test hook: the self-check and the failure memory stay the
    real ones, e.g. for a deliberately wrong op table on CPU)."""
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
            ops = make_ops(device)
            verify_ops(ops, device)
        except CompiledUnavailable as exc:
            _loaded[key] = exc
            raise
        except Exception as exc:  # a build error, or a CUDA error inside the kernels
            wrapped = CompiledUnavailable(f"compiled backend unavailable on {device}: {type(exc).__name__}: {exc}")
            _loaded[key] = wrapped
            raise wrapped from exc
        _loaded[key] = ops
        return ops


def _build_ops(device: torch.device) -> CompiledOps:
    with torch.cuda.device(device):
        return CompiledOps(build_extension(arch_for_device(device)), device)


def load_ops_or_none(device: torch.device | str | int = "cuda", *, make_ops: Callable | None = None):
    """For backend="auto": the compiled ops, or None with a warning saying why the portable path is used."""
    try:
        return load_ops(device, make_ops=make_ops)
    except CompiledUnavailable as exc:
        warnings.warn(f"using the portable decoder: {exc}", RuntimeWarning, stacklevel=2)
        return None
