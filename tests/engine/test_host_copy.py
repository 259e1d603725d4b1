"""``host_copy``: the single-thread host copy the engine uses for per-step values;
``host_copy_split``: a large one split over the engine's copy threads."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dataflow.engine.backends import torch_storage  # noqa: E402
from dataflow.engine.backends.torch_storage import (  # noqa: E402
    as_bytes,
    host_copy,
    host_copy_split,
)


def test_host_copy_writes_every_byte_of_the_source() -> None:
    source = torch.randint(-(2**62), 2**62, (64, 1024), dtype=torch.int64)  # 512 KiB
    target = torch.zeros(source.numel() * 8, dtype=torch.uint8)
    host_copy(target, as_bytes(source))
    assert torch.equal(target.view(torch.int64).view(64, 1024), source)


def test_host_copy_refuses_a_size_mismatch() -> None:
    with pytest.raises(ValueError):
        host_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))


@pytest.mark.parametrize("threads", [1, 3, 4])
@pytest.mark.parametrize("size", [1000, 4096 + 7])
def test_a_split_copy_writes_every_byte_once(monkeypatch, threads, size) -> None:
    """Split in ``threads`` parts (the last one short where ``size`` does not divide),
    every byte lands at its own offset, and a size mismatch is refused before any is
    written."""
    monkeypatch.setattr(torch_storage, "SPLIT_COPY_BYTES", 256)
    monkeypatch.setattr(torch_storage, "HOST_COPY_THREADS", threads)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8)
    target = torch.zeros(size, dtype=torch.uint8)
    host_copy_split(target, source)
    assert torch.equal(target, source)
    if threads > 1:
        with pytest.raises(ValueError, match="host copy of"):
            host_copy_split(torch.zeros(size + 1, dtype=torch.uint8), source)
