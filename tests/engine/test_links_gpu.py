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


def test_links_measured_beside_compute_keep_it_running_through_every_copy() -> None:
    """``beside`` is launched before every timed copy, enough to outlast it: the device
    computed through the whole measurement, on a stream of its own."""
    from dataflow.engine.backends.torch_cuda import measure_links

    a = torch.randn(2048, 2048, device="cuda")
    streams: list = []

    def beside(stream) -> None:
        with torch.cuda.stream(stream):
            torch.mm(a, a)
        streams.append(stream)

    links = measure_links("cuda", size_bytes=16 * 2**20, repeats=3, beside=beside)
    assert links.h2d.bw_bytes_per_us > 0 and links.d2h.bw_bytes_per_us > 0
    # 2 timing launches, then per timed copy group (1 warm-up, 3 x 4 KiB, 3 x h2d,
    # 3 x d2h, 3 x both) at least one launch
    assert len(streams) >= 2 + 13
    assert len({id(s) for s in streams}) == 1
    assert streams[0] != torch.cuda.current_stream()
