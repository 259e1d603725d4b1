"""The links between fast and slow memory fitted from timed copies (``fit_links``): the
one method ``torch_cuda.measure_links`` and ``torch_cpu.measure_host_links`` share, each
timing its copies its own way (CUDA events on copy streams; a worker thread's clock)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

#: the directions, each timed alone and both at once
DIRECTIONS = ("h2d", "d2h")
#: the small copy whose time is a direction's latency
LATENCY_BYTES = 4096


def fit_links(
    timed: Callable[[tuple[str, ...], int], dict[str, float]], size_bytes: int, repeats: int
):
    """``Links`` from ``timed(directions, nbytes)`` (the microseconds each direction's copy
    of ``nbytes`` took, those directions started together): after one warm-up copy of
    each, each direction's latency (a ``LATENCY_BYTES`` copy), its bandwidth copying
    ``size_bytes`` alone less that latency, and the duplex total (both directions' bytes
    over the longer of the two copying at once, less its latency); each the median of
    ``repeats``."""
    from dataflow.schema import Link, Links

    def median_us(directions: tuple[str, ...], nbytes: int) -> dict[str, float]:
        runs = [timed(directions, nbytes) for _ in range(repeats)]
        return {d: statistics.median(run[d] for run in runs) for d in directions}

    timed(DIRECTIONS, size_bytes)  # warm-up: the pages of the destinations
    latency_us = median_us(DIRECTIONS, LATENCY_BYTES)
    links = {}
    for d in DIRECTIONS:
        alone_us = median_us((d,), size_bytes)[d]
        links[d] = Link(
            bw_bytes_per_us=size_bytes / _moving_us(alone_us, latency_us[d]),
            latency_us=latency_us[d],
        )
    both_us = median_us(DIRECTIONS, size_bytes)
    moving_us = max(_moving_us(both_us[d], latency_us[d]) for d in DIRECTIONS)
    return Links(
        h2d=links["h2d"],
        d2h=links["d2h"],
        duplex_bytes_per_us=2 * size_bytes / max(moving_us, 1e-3),
    )


def _moving_us(copy_us: float, latency_us: float) -> float:
    """A copy's time less its latency, but at least half the copy's time: a small copy
    that took longer than half a large one measured a thread's wake-up or a busy core,
    not the link's latency (a CI machine under load timed a 4 KiB copy longer than a
    1 MiB one, which made the bandwidth a billion bytes a microsecond)."""
    return max(copy_us - latency_us, copy_us / 2, 1e-3)
