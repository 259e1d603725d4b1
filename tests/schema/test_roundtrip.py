"""Every schema type survives unstructure -> JSON -> structure unchanged (property tests)."""

from __future__ import annotations

import json

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflow.schema import (
    DTYPE_BYTES,
    Budget,
    Link,
    Links,
    Location,
    Obj,
    Program,
    Role,
    Task,
    TensorMeta,
)
from dataflow.schema.converter import converter

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12)
sizes = st.integers(min_value=-(2**40), max_value=2**50)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)

tensor_metas = st.builds(
    TensorMeta,
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
    shape=st.lists(st.integers(0, 4096), max_size=4).map(tuple),
)
objs = st.builds(
    Obj,
    id=ids,
    size_bytes=sizes,
    role=st.sampled_from(list(Role)),
    location=st.sampled_from(list(Location)),
    tensor=st.none() | tensor_metas,
)
id_lists = st.lists(ids, max_size=4).map(tuple)
tasks = st.builds(
    Task,
    id=ids,
    kind=ids,
    compute_key=st.text(max_size=20),
    params=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    inputs=id_lists,
    mutates=id_lists,
    outputs=id_lists,
    workspace_bytes=sizes,
    cost_us=finite,
    releases=id_lists,
    offloads=id_lists,
    prefetches=id_lists,
    label=st.text(max_size=10),
)
links_ = st.builds(Link, bw_bytes_per_us=finite, latency_us=finite)
linkss = st.builds(
    Links,
    h2d=links_,
    d2h=links_,
    duplex_bytes_per_us=st.none() | st.floats(min_value=1e-3, max_value=1e9),
)
budgets = st.builds(Budget, fast_bytes=sizes, slow_bytes=st.none() | sizes)
programs = st.builds(
    Program,
    name=st.text(max_size=12),
    objects=st.lists(objs, max_size=5).map(tuple),
    tasks=st.lists(tasks, min_size=1, max_size=5).map(tuple),  # a program has a task
    final_locations=st.dictionaries(ids, st.sampled_from(list(Location)), max_size=3),
    budget=st.none() | budgets,
    links=linkss,
    metadata=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
)


def _through_json(value, kind):
    return converter.structure(json.loads(json.dumps(converter.unstructure(value))), kind)


@given(tensor_metas)
def test_tensor_meta_roundtrip(meta: TensorMeta) -> None:
    assert _through_json(meta, TensorMeta) == meta


@given(objs)
def test_obj_roundtrip(obj: Obj) -> None:
    assert _through_json(obj, Obj) == obj


@given(tasks)
def test_task_roundtrip(task: Task) -> None:
    assert _through_json(task, Task) == task


@given(linkss)
def test_links_roundtrip(links: Links) -> None:
    assert _through_json(links, Links) == links


@given(budgets)
def test_budget_roundtrip(budget: Budget) -> None:
    assert _through_json(budget, Budget) == budget


@settings(max_examples=60)
@given(programs)
def test_program_roundtrip_through_json_text(program: Program) -> None:
    text = program.to_json()
    again = Program.from_json(text)
    assert again == program
    assert again.to_json() == text


def test_structured_values_have_their_declared_types() -> None:
    program = Program.from_json(
        json.dumps(
            {
                "schema": "dataflow.program/v1",
                "name": "p",
                "objects": [{"id": "a", "size_bytes": 4, "role": "param", "location": "fast"}],
                "tasks": [{"id": "t", "kind": "k", "compute_key": "k", "inputs": ["a"]}],
                "final_locations": {"a": "slow"},
            }
        )
    )
    assert program.objects[0].role is Role.PARAM
    assert program.objects[0].location is Location.FAST
    assert program.tasks[0].inputs == ("a",)
    assert program.final_locations == {"a": Location.SLOW}
    assert isinstance(program.tasks[0].cost_us, float)


def test_prologue_and_persistent_round_trip_and_are_left_out_when_empty() -> None:
    from dataflow.schema import Prologue
    from dataflow.testing.shapes import tiny_training

    bare = tiny_training()
    assert "prologue" not in bare.to_dict() and "persistent" not in bare.to_dict()
    program = attrs.evolve(bare, prologue=Prologue(prefetches=("W0",)), persistent=("W0", "O0"))
    document = program.to_dict()
    assert document["prologue"]["prefetches"] == ["W0"] and document["persistent"] == ["W0", "O0"]
    assert Program.from_json(program.to_json()) == program


def test_the_duplex_limit_round_trips_and_is_left_out_when_absent() -> None:
    from dataflow.testing.shapes import tiny_training

    bare = tiny_training()
    assert "duplex_bytes_per_us" not in bare.to_dict()["links"]
    program = attrs.evolve(bare, links=attrs.evolve(bare.links, duplex_bytes_per_us=98947.0))
    assert program.to_dict()["links"]["duplex_bytes_per_us"] == 98947.0
    assert Program.from_json(program.to_json()) == program
