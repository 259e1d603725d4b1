"""Byte sizes as people write them: ``4GiB``, ``512MB``, ``1.5e9``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse ``"4GiB"``, ``"300MB"``, ``"1024"`` or an int into a whole number of bytes.

    Raises ``ValueError`` naming the text when it is not a size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text!r} is negative")
        return text
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; write a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 4GiB"
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if size == float("inf"):
        raise ValueError(f"{text!r} is too large a size; give at most a few TiB, e.g. 4GiB")
    return int(size)


def format_size(size_bytes: float) -> str:
    """Format bytes with a binary unit and three significant digits: ``1.5 GiB``,
    ``781 KiB``; from 999.5 to 1023.99 of a unit, the whole number (``1000 KiB``), never
    scientific notation."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{_three_digits(value) if unit != 'B' else f'{value:.0f}'} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _three_digits(value: float) -> str:
    text = f"{value:.3g}"
    return f"{value:.0f}" if "e" in text else text
