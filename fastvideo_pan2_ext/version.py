"""The package's version: the one definition (pyproject.toml reads it too)."""

__version__ = "0.2.0"
