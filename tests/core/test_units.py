"""Sizes read and written as people do: never scientific notation, a bad size is named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataflow.units import format_size, parse_size


@pytest.mark.parametrize(
    ("size_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (799744, "781 KiB"),
        (1000 * 1024, "1000 KiB"),
        (int(999.7 * 1024), "1000 KiB"),
        (1023 * 1024 + 1000, "1024 KiB"),
        (96 * 2**20, "96 MiB"),
        (2**40 * 5000, "5000 TiB"),
    ],
)
def test_format_size(size_bytes: int, text: str) -> None:
    assert format_size(size_bytes) == text


@given(st.integers(min_value=0, max_value=2**60))
def test_format_size_never_uses_scientific_notation(size_bytes: int) -> None:
    number, unit = format_size(size_bytes).split(" ")
    assert "e" not in number
    assert unit in {"B", "KiB", "MiB", "GiB", "TiB"}
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    # three significant digits: within half a unit of the third digit (or of 1 whole unit)
    assert abs(float(number) * scale - size_bytes) <= max(0.005 * size_bytes, 0.5 * scale)


@pytest.mark.parametrize(
    ("text", "size_bytes"),
    [("4GiB", 4 * 2**30), ("300MB", 300 * 10**6), ("1024", 1024), ("1.5e3", 1500), (7, 7)],
)
def test_parse_size(text: str | int, size_bytes: int) -> None:
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize("text", ["4 gigs", "-1", "", "1..5MiB", "MiB"])
def test_parse_size_names_the_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1e400", "1e308TiB"])
def test_parse_size_refuses_an_infinite_size(text: str) -> None:
    with pytest.raises(ValueError, match="too large a size"):
        parse_size(text)
