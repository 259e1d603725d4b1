"""Fed values copied into the slow pool while the step runs
(``backends.torch_feed_copies``, on by default on CUDA; forced here on the CPU backend):
each step computes what it computes with the values copied before it, byte for byte, with
copies slowed to milliseconds so a transfer that did not wait for its object's copy would
read stale bytes; the copies start
in the order the step first fetches their objects."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from dataflow.engine import DictResolver, Engine  # noqa: E402
from dataflow.engine.backends import torch_feed_copies  # noqa: E402
from dataflow.planning import plan  # noqa: E402
from dataflow.schema import Link, Links, Location, Obj, Program, Role, Task  # noqa: E402

KiB = 2**10
FED = 6
#: a fed object's bytes: several of the parts a copy is split into (``SPLIT_COPY_BYTES``,
#: lowered by the fixture) so that one object's copy runs on several threads
SIZE = 64 * KiB
#: how long each part of a slowed copy takes
COPY_SLEEP_S = 0.003


def program() -> Program:
    """Task ``t{i}`` reads the fed ``x{i}`` (slow at the start: the plan fetches it) and
    writes ``y{i}``, its bytes times ``i + 1`` (wrapping), written back at the end."""
    objects = [Obj(f"x{i}", SIZE, Role.DATA, Location.SLOW) for i in range(FED)]
    objects += [Obj(f"y{i}", SIZE, Role.ACTIVATION) for i in range(FED)]
    tasks = [
        Task(f"t{i}", "scale", "scale", inputs=[f"x{i}"], outputs=[f"y{i}"], cost_us=200.0)
        for i in range(FED)
    ]
    links = Links(h2d=Link(1_000.0, 5.0), d2h=Link(1_000.0, 5.0))
    finals = {f"y{i}": Location.SLOW for i in range(FED)}  # written back: fetched there
    return Program(name="fed", objects=objects, tasks=tasks, links=links, final_locations=finals)


class Scale:
    def __init__(self, task: Task) -> None:
        self.factor = int(task.id[1:]) + 1

    def launch(self, ctx) -> None:
        (x,), (y,) = ctx.inputs, ctx.outputs
        y.copy_(x).mul_(self.factor)


def fed(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        f"x{i}": torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g) for i in range(FED)
    }


@pytest.fixture
def slow_feed_copies(monkeypatch):
    """Copies into the slow pool (``torch_storage.copy_parts``, the copy threads') split
    into 16 KiB parts, each taking milliseconds; the transfers' copies as they are."""
    from dataflow.engine.backends import torch_storage

    monkeypatch.setattr(torch_storage, "SPLIT_COPY_BYTES", 16 * KiB)
    pool = ThreadPoolExecutor(4, thread_name_prefix="slow-copy")

    def slow_parts(dst, src, part_bytes):
        def part(at: int) -> None:
            time.sleep(COPY_SLEEP_S)
            dst[at : at + part_bytes].copy_(src[at : at + part_bytes])

        return [pool.submit(part, at) for at in range(0, src.numel(), part_bytes)]

    monkeypatch.setattr(torch_storage, "copy_parts", slow_parts)
    yield
    pool.shutdown()


def run(deferred: bool, steps: int = 3, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    planned = plan(program(), 4 * SIZE + FED * SIZE)
    resolver = DictResolver("scale", {"scale": Scale})
    seen = []
    with Engine("torch", device=device) as engine:
        engine.load(planned, resolver, initial=fed(0))
        engine._backend.defer_feeds = deferred
        for _ in range(steps):
            engine.run(feed=fed)
            seen.append({f"y{i}": engine.fetch(f"y{i}") for i in range(FED)})
    return seen


def check(device: str) -> None:
    """Three steps with the copies before each and while it runs: the same bytes."""
    want = [{f"y{i}": fed(step)[f"x{i}"] * (i + 1) for i in range(FED)} for step in range(3)]
    for deferred in (False, True):
        seen = run(deferred, device=device)
        for step, (got, expected) in enumerate(zip(seen, want, strict=True)):
            for name, value in expected.items():
                assert torch.equal(got[name], value), (deferred, step, name)


def test_a_step_with_copies_arriving_computes_what_copies_before_it_give(slow_feed_copies):
    check("cpu")


@pytest.mark.gpu
def test_on_cuda_a_step_with_copies_arriving_computes_the_same(slow_feed_copies):
    check("cuda")


def test_copies_start_in_the_order_the_step_first_fetches_their_objects() -> None:
    started: list[str] = []

    class Recording(torch_feed_copies.FeedCopies):
        def start(self) -> None:
            order = sorted(self.queued, key=lambda o: self.first.get(o, len(self.first) + 1))
            started.extend(order)
            super().start()

    chain = program()
    first = torch_feed_copies.first_fetch(plan(chain, 4 * SIZE + FED * SIZE).program)
    copies = Recording(first)
    for i in reversed(range(FED)):  # added last-first
        copies.add(f"x{i}", torch.empty(SIZE, dtype=torch.uint8), fed(0)[f"x{i}"])
    copies.wait_all()
    assert started == sorted(started, key=lambda o: first[o]) and len(started) == FED
    assert first == {f"x{i}": first[f"x{i}"] for i in range(FED)}  # every fed object fetched
