"""PAN2's FastVideo pipeline configuration and preset (filled in by the PAN2 pipeline work)."""
