"""When to turn on FlashAttention-4 for PAN2, and turning it on.

FastVideo 0.2.1 uses FA4 (``flash_attn.cute``) only with ``FASTVIDEO_FA4=1``, and reads that variable once per
process, when its flash-attention modules are first imported (which happens while the pipeline loads the DiT). PAN2
wants FA4 where it is the fastest correct choice: on datacenter Blackwell (sm_100, sm_103) with FA4 installed. An explicit
``FASTVIDEO_FA4`` is the user's choice and is always respected; it must be ``0`` or ``1`` (FastVideo itself reads
any value but ``0`` as on, so a typo would silently turn FA4 on: refused instead).

The policy runs where FastVideo's attention is about to be chosen: in `PAN2Pipeline.__init__`, in each process that
builds the pipeline, before the DiT loads (building a config changes nothing). Only FastVideo's platform-independent pieces and the standard library are
used; torch only to read the device capability.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV_VAR = "FASTVIDEO_FA4"
ACCEPTED_VALUES = ("0", "1")
# FA4's kernels target datacenter Blackwell: sm_100 (B200, GB200) and sm_103 (B300, GB300). Not sm_120 (the
# RTX 50 series), whose tensor cores have no tcgen05.
FA4_CAPABILITIES = ((10, 0), (10, 3))


def _current_capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def fa4_importable() -> bool:
    """Whether ``flash_attn.cute`` (FA4) imports in this process."""
    try:
        importlib.import_module("flash_attn.cute")
    except Exception:  # ImportError, or a broken install failing at import: either way not usable
        return False
    return True


def fa4_decision(capability=None, environ=None) -> bool:
    """Would PAN2 turn FA4 on? True iff the device is datacenter Blackwell
    (`FA4_CAPABILITIES`: sm_100, sm_103), `flash_attn.cute` imports, and
    ``FASTVIDEO_FA4`` is unset. `capability` is (major, minor) (default: the current CUDA device's; no device ->
    False); `environ` defaults to ``os.environ``. Changes nothing."""
    environ = os.environ if environ is None else environ
    if ENV_VAR in environ:
        check_env_value(environ[ENV_VAR])
        return False
    if capability is None:
        capability = _current_capability()
        if capability is None:
            return False
    if (not isinstance(capability, (tuple, list)) or len(capability) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in capability)):
        raise ValueError(f"capability must be a (major, minor) pair of ints; got {capability!r}")
    if tuple(capability) not in FA4_CAPABILITIES:
        return False
    return fa4_importable()


def check_env_value(value: str) -> None:
    """ValueError unless an explicit FASTVIDEO_FA4 is one of the accepted values."""
    if value not in ACCEPTED_VALUES:
        raise ValueError(f"{ENV_VAR} must be unset, 0 or 1; got {value!r} (unset: PAN2 turns FA4 on where it is the "
                         "fastest correct choice)")


def loaded_fa4_readers() -> list[str]:
    from fastvideo_pan2_ext.fastvideo_integration.compat.models import FA4_READERS  # noqa: PLC0415 - FastVideo's

    return [name for name in FA4_READERS if name in sys.modules]


def apply_fa4_policy() -> bool:
    """Set ``FASTVIDEO_FA4=1`` when `fa4_decision()` says so; returns whether it did.

    If FastVideo's flash-attention modules are already imported in this process, the setting still reaches workers
    started later, but this process keeps its backend: that is logged as a warning, not skipped silently.
    """
    if not fa4_decision():
        logger.debug("FA4 policy: leaving %s=%r", ENV_VAR, os.environ.get(ENV_VAR))
        return False
    os.environ[ENV_VAR] = "1"
    loaded = loaded_fa4_readers()
    if loaded:
        logger.warning("FA4 policy: set %s=1, but %s already imported in this process, so it keeps its current "
                       "attention backend (workers started from now on use FA4)", ENV_VAR, ", ".join(loaded))
    else:
        logger.info("FA4 policy: sm_100+ with flash_attn.cute installed; set %s=1", ENV_VAR)
    return True
