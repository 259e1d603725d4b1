"""Shared fixtures: the shipped test data, and shards of known tokens written with the
package's own writer (every token distinct, so a token names its place in the dataset)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from dataflow_feed_shards.shard_format import write_shard

DATA = Path(__file__).parent / "data"


def _write_shards(folder: Path, sizes: list[int], version: int = 1) -> np.ndarray:
    """Shards ``shard_000.bin``... of ``sizes`` tokens holding ids 0, 1, 2... in name
    order; returns all the tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.arange(sum(sizes), dtype=np.int64)
    ends = np.cumsum(sizes)
    for index, (size, end) in enumerate(zip(sizes, ends, strict=True)):
        write_shard(folder / f"shard_{index:03d}.bin", tokens[end - size : end], version)
    return tokens


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def write_shards() -> Callable[..., np.ndarray]:
    return _write_shards


@pytest.fixture
def counting_shards(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """Five uint16 shards of distinct tokens (5,000 in all)."""
    folder = tmp_path / "counting"
    return folder, _write_shards(folder, [1000, 700, 1300, 900, 1100])
