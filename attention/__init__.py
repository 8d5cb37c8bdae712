"""The FA4 attention policy for the PAN2 pipeline (filled in by the PAN2 pipeline work)."""
