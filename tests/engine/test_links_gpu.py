"""``measure_links`` on CUDA: each direction alone, and the two at once (the duplex total
the simulator shares while both copy)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_measured_links_carry_each_direction_alone_and_the_duplex_total() -> None:
    from dataflow.engine.backends.torch_cuda import measure_links

    links = measure_links("cuda")
    h2d, d2h = links.h2d.bw_bytes_per_us, links.d2h.bw_bytes_per_us
    total = links.duplex_bytes_per_us
    assert total is not None and h2d > 0 and d2h > 0
    assert links.h2d.latency_us > 0 and links.d2h.latency_us > 0
    # both at once move more than either alone (two copy engines), and never much more
    # than the two alone (5 % for timing noise)
    assert max(h2d, d2h) < total <= 1.05 * (h2d + d2h), (h2d, d2h, total)
    shared = links.shared_bw
    assert shared[0] <= h2d and shared[1] <= d2h
