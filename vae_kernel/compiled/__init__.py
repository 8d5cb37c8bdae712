"""The compiled CUDA backend: sources (`csrc/`), the content-keyed build cache (`build`), the extension's loading
(`extension`), its kernels as an op table (`kernels`), the self-check and its verdicts (`selfcheck`,
`verification`). The rest of the decoder enters it only here, through `load_ops` and `CompiledUnavailable`
(`vae_kernel.backends`)."""

from .extension import CompiledUnavailable
from .loader import load_ops

__all__ = ["CompiledUnavailable", "load_ops"]
