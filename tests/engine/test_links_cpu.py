"""``measure_links`` on a CPU: fast and slow memory are both the host's, so the links are
a worker thread's copy between host buffers, as the CPU runner copies, timed beside a
task running on a thread of its own."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")


def test_cpu_links_are_host_copies_each_way_and_both_at_once() -> None:
    from dataflow import measure_links

    links = measure_links("cpu", size_bytes=2**20, repeats=3)
    h2d, d2h = links.h2d.bw_bytes_per_us, links.d2h.bw_bytes_per_us
    assert h2d > 0 and d2h > 0 and links.duplex_bytes_per_us > 0
    assert links.h2d.latency_us >= 0 and links.d2h.latency_us >= 0
    # a host memcpy: far from the defaults' 1 byte per microsecond, and short of 1 TB/s
    assert 100 < h2d < 1e6 and 100 < d2h < 1e6, (h2d, d2h)


def test_cpu_links_are_measured_while_the_task_beside_them_runs() -> None:
    """``beside(None)`` runs in place on a thread of its own through the timed copies
    (as the compute worker runs a step's tasks while its copies go), and has stopped
    when the measurement returns."""
    from dataflow import measure_links

    a = torch.randn(256, 256)
    threads: set[str] = set()
    launches = []

    def beside(stream) -> None:
        assert stream is None
        threads.add(threading.current_thread().name)
        torch.mm(a, a)
        launches.append(1)

    measure_links("cpu", size_bytes=2**20, repeats=3, beside=beside)
    done = len(launches)
    assert done >= 1 and threads == {"dataflow-beside"}
    assert len(launches) == done  # stopped


def test_a_latency_longer_than_the_copy_does_not_make_the_link_infinite() -> None:
    """A busy machine can time the small latency copy longer than the large one; the
    bandwidth then comes from at least half the large copy's time, never from what is
    left after a latency larger than it."""
    from dataflow.engine.backends.link_fit import fit_links

    def timed(directions, nbytes):  # 4 KiB takes 300 us, 1 MiB 100 us (a noisy machine)
        return {d: 300.0 if nbytes <= 4096 else 100.0 for d in directions}

    links = fit_links(timed, 2**20, repeats=3)
    assert links.h2d.bw_bytes_per_us == links.d2h.bw_bytes_per_us == 2**20 / 50
    assert links.duplex_bytes_per_us == 2 * 2**20 / 50
    assert links.h2d.latency_us == 300.0
