"""The FA4 attention policy for the PAN2 pipeline (see `fa4`)."""

from fastvideo_pan2_ext.attention.fa4 import ENV_VAR, FA4_CAPABILITIES, apply_fa4_policy, fa4_decision

__all__ = ["ENV_VAR", "FA4_CAPABILITIES", "apply_fa4_policy", "fa4_decision"]
