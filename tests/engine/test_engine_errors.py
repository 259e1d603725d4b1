"""The engine's errors name the task, resolver and objects at fault."""

from __future__ import annotations

import attrs
import pytest
import torch

from dataflow.engine import DictResolver, Engine, EngineLoadError, EngineRunError, ResolverError
from dataflow.schema import Obj, Program, Task, TensorMeta

F32x4 = TensorMeta("float32", (4,))
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Fill:
    def __init__(self, value: float) -> None:
        self.value = value

    def launch(self, ctx) -> None:
        for out in ctx.outputs:
            out.fill_(self.value)
        for mutated in ctx.mutates:
            mutated.add_(self.value)


def _resolver() -> DictResolver:
    return DictResolver("fill", {"one": lambda task: Fill(1.0), "two": lambda task: Fill(2.0)})


def _program(**fields) -> Program:
    base = Program(
        name="tiny",
        objects=(
            Obj("a", 16, "data", "fast", F32x4),
            Obj("w", 16, "param", "slow", F32x4),
            Obj("b", 16, "activation", tensor=F32x4),
        ),
        tasks=(
            Task("t0", "k", "one", inputs=("a",), outputs=("b",), prefetches=("w",)),
            Task("t1", "k", "two", inputs=("b",), mutates=("w",), offloads=("w",)),
        ),
        final_locations={"w": "slow"},
    )
    return attrs.evolve(base, **fields)


def _initial() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(4), "w": torch.zeros(4)}


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_program_runs_and_its_values_read_back(device: str) -> None:
    engine = Engine("torch", device=device)
    engine.load(_program(), _resolver(), initial=_initial())
    engine.run(steps=2)
    assert torch.equal(engine.fetch("w"), torch.full((4,), 4.0))  # +2 per step, two steps


@pytest.mark.parametrize("device", DEVICES)
def test_scalars_read_together_are_each_what_read_scalar_gives(device: str) -> None:
    """One-element objects of two dtypes, fast and slow, read in one call: each value is
    what ``read_scalar`` reads alone, in the order asked; an unknown one is named."""
    one = TensorMeta("float32", (1,))
    half = TensorMeta("bfloat16", (1,))
    program = Program(
        name="scalars",
        objects=(
            Obj("a", 4, "data", "fast", one),
            Obj("s", 4, "data", "slow", one),
            Obj("h", 2, "data", "fast", half),
            Obj("x", 4, "activation", tensor=one),
            Obj("y", 2, "activation", tensor=half),
        ),
        tasks=(
            Task("t0", "k", "one", inputs=("a",), outputs=("x",)),
            Task("t1", "k", "two", inputs=("h",), outputs=("y",)),
        ),
        final_locations={"x": "fast", "y": "fast"},
    )
    engine = Engine("torch", device=device)
    initial = {
        "a": torch.zeros(1),
        "s": torch.tensor([0.1]),
        "h": torch.tensor([3.0], dtype=torch.bfloat16),
    }
    engine.load(program, _resolver(), initial=initial)
    engine.run(steps=1)
    names = ["y", "s", "x", "a", "h"]
    assert engine.read_scalars(names) == [engine.read_scalar(n) for n in names]
    assert engine.read_scalars(names) == [2.0, float(torch.tensor(0.1)), 1.0, 0.0, 3.0]
    with pytest.raises(KeyError, match="nope"):
        engine.read_scalars(["x", "nope"])


def test_unknown_compute_key_fails_at_load_naming_task_and_resolver() -> None:
    program = _program()
    program = attrs.evolve(
        program, tasks=(attrs.evolve(program.tasks[0], compute_key="three"), program.tasks[1])
    )
    with pytest.raises(
        ResolverError,
        match="task 't0': resolver 'fill' cannot run compute key 'three'.*known keys: one, two",
    ):
        Engine("torch").load(program, _resolver(), initial=_initial(), resolver_name="fill")


def test_missing_and_unknown_initial_values_are_named() -> None:
    with pytest.raises(
        EngineLoadError, match="no initial value for 'w'.*objects that do not exist at start: 'b'"
    ):
        Engine("torch").load(
            _program(), _resolver(), initial={"a": torch.zeros(4), "b": torch.zeros(4)}
        )


def test_initial_value_of_the_wrong_size() -> None:
    with pytest.raises(
        ValueError, match="initial value of 'a' has 32 bytes, the program declares 16"
    ):
        Engine("torch").load(
            _program(), _resolver(), initial={"a": torch.zeros(8), "w": torch.zeros(4)}
        )


def test_structurally_invalid_program_is_refused() -> None:
    program = _program(final_locations={"ghost": "slow"})
    with pytest.raises(EngineLoadError, match="final_locations names unknown object 'ghost'"):
        Engine("virtual").load(program)


@pytest.mark.parametrize(
    ("backend", "device"),
    [("virtual", "cpu"), ("torch", "cpu"), pytest.param("torch", "cuda", marks=pytest.mark.gpu)],
)
def test_use_of_a_never_fetched_object_names_it(backend: str, device: str) -> None:
    program = _program()
    program = attrs.evolve(
        program, tasks=(attrs.evolve(program.tasks[0], prefetches=()), program.tasks[1])
    )
    engine = Engine(backend, device=device)
    engine.load(program, _resolver(), initial=_initial())
    with pytest.raises(
        EngineRunError,
        match="task 't1' needs 'w', but it is not in fast memory and nothing prefetches it",
    ) as caught:
        engine.run()
    assert caught.value.task == "t1" and caught.value.objects == ("w",)


def test_deadlock_names_the_blocked_task_and_memory() -> None:
    # 'w' (16 B) is prefetched, but the budget leaves no room for it next to 'a' and 'b'.
    engine = Engine("virtual", budget_bytes=40)
    engine.load(_program())
    with pytest.raises(
        EngineRunError,
        match="deadlock: task 't1' cannot start: waiting for w.*"
        "h2d head: 'w'.*fast memory in use: 32 bytes",
    ) as caught:
        engine.run()
    assert caught.value.kind == "deadlock" and caught.value.task == "t1"


def test_final_locations_are_checked() -> None:
    program = _program()
    program = attrs.evolve(
        program, tasks=(program.tasks[0], attrs.evolve(program.tasks[1], offloads=()))
    )
    engine = Engine("virtual")
    engine.load(program)
    with pytest.raises(
        EngineRunError, match="'w' should end in slow memory but has no current slow copy"
    ):
        engine.run()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_executable_is_reported_with_its_task(device: str) -> None:
    class Boom:
        def launch(self, ctx) -> None:
            raise RuntimeError("kaboom")

    resolver = DictResolver("boom", {"one": lambda task: Boom(), "two": lambda task: Fill(1)})
    engine = Engine("torch", device=device)
    engine.load(_program(), resolver, initial=_initial())
    with pytest.raises(EngineRunError, match="task 't0' raised RuntimeError: kaboom"):
        engine.run()


@pytest.mark.parametrize("device", DEVICES)
def test_fetch_of_a_dropped_object(device: str) -> None:
    program = _program()
    program = attrs.evolve(
        program, tasks=(program.tasks[0], attrs.evolve(program.tasks[1], releases=("b",)))
    )
    engine = Engine("torch", device=device)
    engine.load(program, _resolver(), initial=_initial())
    engine.run()
    with pytest.raises(KeyError, match="'b' has no value after the run"):
        engine.fetch("b")
    with pytest.raises(KeyError, match="no object 'zz'"):
        engine.fetch("zz")
