"""The one-line form of an error, as every message of this package that quotes an error shows it."""

from __future__ import annotations


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of `exc`'s message (its type's name when the message is empty or blank), after its type and a
    colon with `with_type`."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return f"{type(exc).__name__}: {lines[0]}" if with_type else lines[0]
