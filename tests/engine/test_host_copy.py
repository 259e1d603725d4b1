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


def test_an_engine_fed_through_split_copies_runs_the_steps_of_one_thread(monkeypatch) -> None:
    """The matmul chain fed fresh start values every step (its input and weights, each a
    few KiB): copied in split over four threads, its results after each step are those
    of the copies on one thread, bit for bit."""
    from dataflow import Engine, minimal_budget, plan

    chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")
    matmul = pytest.importorskip("dataflow_resolver_matmul_chain.resolver")
    program = chain.build_program(layers=3, dim=32, batch=16)
    budget = minimal_budget(program)
    planned = plan(program, budget)
    feeds = [chain.initial_values(program, seed=seed) for seed in range(4)]
    finals = [obj.id for obj in program.objects if obj.id.startswith("W_")]
    results = {}
    for threads in (1, 4):
        monkeypatch.setattr(torch_storage, "SPLIT_COPY_BYTES", 256)
        monkeypatch.setattr(torch_storage, "HOST_COPY_THREADS", threads)
        seen = []
        with Engine("torch", budget_bytes=budget, device="cpu") as engine:
            engine.load(planned, matmul.build(planned.program), initial=feeds[0])
            for step in range(1, 4):
                engine.run(feed=lambda _, step=step: feeds[step])
                seen.append([engine.fetch(obj).clone() for obj in finals])
        results[threads] = seen
    assert any(t.numel() * t.element_size() >= 1024 for t in feeds[1].values())  # split
    for one, split in zip(results[1], results[4], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(one, split, strict=True))
