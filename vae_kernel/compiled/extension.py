"""The decoder's CUDA extension as a build: its sources, flags and target architecture (built through `build.py`'s
content-keyed cache). Nothing here runs a kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from pathlib import Path

import torch

from fastvideo_pan2_ext.version import __version__

from . import build

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "conv3d_cutlass.cu", "rms_norm_silu.cu", "upsample_subpixel.cu", "winograd.cu")
HEADERS = ("decode_kernels.h", "winograd_tiles.cuh")
EXTENSION_PREFIX = "wan22_vae_decode_"  # + arch: builds for two GPU kinds can live in one process
CUTLASS_DIR_ENV = "WAN22_CUTLASS_DIR"  # a CUTLASS source tree (include/, tools/util/include/) instead of the wheel's



@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPU architecture the kernels are built for: its compute capability and the kernels' CUTLASS collective
    family (the macro csrc/ selects its collectives by). The build passes the capability to the C++ as WAN22_ARCH
    (major x 10 + minor), from which the module names itself: this table is the only list of architectures."""

    capability: tuple[int, int]
    family: str  # "WAN22_SM90": TMA/WGMMA; "WAN22_SM100": UMMA (tcgen05)

    @property
    def name(self) -> str:  # nvcc's arch-specific target
        return f"sm_{self.capability[0]}{self.capability[1]}a"


ARCHS = {arch.name: arch for arch in (Arch((9, 0), "WAN22_SM90"), Arch((10, 0), "WAN22_SM100"),
                                      Arch((10, 3), "WAN22_SM100"))}


class CompiledUnavailable(RuntimeError):
    """The compiled backend cannot be used here (no GPU, unsupported GPU, no toolchain, failed build or self-check)."""


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
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}; got {arch!r}")
    major, minor = ARCHS[arch].capability
    cutlass = cutlass_source_dir()
    includes = (str(cutlass / "include"), str(cutlass / "tools" / "util" / "include"), str(CSRC))
    # Hidden visibility: the template instantiations of two builds loaded into one process (one per GPU kind) would
    # otherwise bind to each other's copies (GCC's process-wide unique symbols; measured: the sm_100a module ran the
    # sm_90a module's code).
    cuda_flags = (
        "-O3", "-Xcompiler=-fvisibility=hidden",
        "-DNDEBUG",  # without it ptxas serializes wgmma (warning C7510)
        f"-D{ARCHS[arch].family}", f"-DWAN22_ARCH={major * 10 + minor}",
        "--expt-relaxed-constexpr", "--expt-extended-lambda",
        # torch's defaults hide the half/bf16 operators CUTLASS relies on
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-Xptxas=-v",  # registers, spills and shared memory of every kernel, kept in the build log
    )
    return build.ExtensionSpec(
        name=extension_name(arch),
        sources=tuple(str(CSRC / s) for s in SOURCES),
        depends=tuple(str(CSRC / h) for h in HEADERS),
        extra_cflags=("-O3", "-fvisibility=hidden"),
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=includes,
        cuda_archs=(arch,),
        key_extras=(("cutlass", cutlass_version(cutlass)), ("package", __version__)),
    )


def arch_for_device(device: torch.device) -> str:
    capability = tuple(torch.cuda.get_device_capability(device))
    for arch in ARCHS.values():
        if arch.capability == capability:
            return arch.name
    raise CompiledUnavailable(f"no compiled kernels for compute capability {capability[0]}.{capability[1]} "
                              f"(built for {sorted(a.capability for a in ARCHS.values())})")


@dataclasses.dataclass(frozen=True)
class ExtensionSource:
    """Where an extension comes from, in a form another process can open again (the self-check runs in a child):
    `function(*args)` of module `module`, importable with `path` (if any) first on the child's path. The built
    extension's is `built(arch)`; tests and CPU rehearsals hand the loader a stand-in's."""

    module: str
    function: str
    args: tuple[str, ...] = ()
    path: str | None = None

    def open(self):
        return getattr(importlib.import_module(self.module), self.function)(*self.args)

    def to_argv(self) -> list[str]:
        return [self.path or "", self.module, self.function, *self.args]

    @classmethod
    def from_argv(cls, argv: list[str]) -> "ExtensionSource":
        path, module, function, *args = argv
        return cls(module, function, tuple(args), path or None)


def built(arch: str) -> ExtensionSource:
    """The source of the extension built for `arch` (from the build cache)."""
    return ExtensionSource(__name__, "build_extension", (arch,))


def build_extension(arch: str, root: str | os.PathLike | None = None, timeout_s: float | None = None):
    """Build (or load from the cache) the extension for `arch`; works without a GPU (compile and import only). A
    compile that outlasts `timeout_s` is killed (BuildError)."""
    if build.cuda_home() is None:
        raise CompiledUnavailable("no CUDA toolkit (nvcc) found: set CUDA_HOME")
    return build.load_extension(extension_spec(arch), root=root, timeout_s=timeout_s)
