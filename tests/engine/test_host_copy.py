"""``host_copy``: the single-thread host copy the engine uses for per-step values."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dataflow.engine.backends.torch_storage import as_bytes, host_copy  # noqa: E402


def test_host_copy_writes_every_byte_of_the_source() -> None:
    source = torch.randint(-(2**62), 2**62, (64, 1024), dtype=torch.int64)  # 512 KiB
    target = torch.zeros(source.numel() * 8, dtype=torch.uint8)
    host_copy(target, as_bytes(source))
    assert torch.equal(target.view(torch.int64).view(64, 1024), source)


def test_host_copy_refuses_a_size_mismatch() -> None:
    with pytest.raises(ValueError):
        host_copy(torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))
