"""Golden JSON files: the wire form is stable, and it reads back into the expected records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.schema import (
    Budget,
    Link,
    Links,
    Location,
    Obj,
    Program,
    Role,
    Task,
    TensorMeta,
    validate,
)

GOLDEN = Path(__file__).parent / "golden"


def _expected_two_layer_chain() -> Program:
    f32 = "float32"
    return Program(
        name="two-layer-chain",
        objects=(
            Obj("W_0", 4096, Role.PARAM, Location.SLOW, TensorMeta(f32, (32, 32))),
            Obj("W_1", 4096, Role.PARAM, Location.SLOW, TensorMeta(f32, (32, 32))),
            Obj("x", 512, Role.DATA, Location.FAST, TensorMeta(f32, (4, 32))),
            Obj("y_0", 512, Role.ACTIVATION, Location.FAST, TensorMeta(f32, (4, 32))),
            Obj("y_1", 512, Role.OUTPUT, Location.FAST, TensorMeta(f32, (4, 32))),
        ),
        tasks=(
            Task(
                "fwd_0_0_0",
                "fwd",
                "matmul",
                {"layer": 0},
                ("x", "W_0"),
                (),
                ("y_0",),
                cost_us=12.5,
                releases=("x",),
                label="layer 0",
            ),
            Task(
                "fwd_0_0_1",
                "fwd",
                "matmul",
                {"layer": 1},
                ("y_0", "W_1"),
                (),
                ("y_1",),
                workspace_bytes=256,
                cost_us=12.5,
                releases=("W_0", "W_1", "y_0"),
                offloads=("y_1",),
                label="layer 1",
            ),
        ),
        final_locations={"y_1": Location.SLOW},
        budget=Budget(fast_bytes=65536),
        links=Links(h2d=Link(25000.0, 5.0), d2h=Link(20000.0, 5.0)),
        metadata={"made_by": "hand"},
    )


def test_golden_reads_into_expected_records() -> None:
    assert Program.from_json(GOLDEN / "two_layer_chain.json") == _expected_two_layer_chain()


def test_golden_text_is_what_to_json_writes() -> None:
    text = (GOLDEN / "two_layer_chain.json").read_text()
    assert json.loads(_expected_two_layer_chain().to_json()) == json.loads(text)


def test_a_v1_document_migrates_to_the_same_records() -> None:
    """v2 added the prologue and persistent objects; a v1 file has neither."""
    text = (GOLDEN / "two_layer_chain_v1.json").read_text()
    assert json.loads(text)["schema"] == "dataflow.program/v1"
    assert Program.from_json(text) == _expected_two_layer_chain()


def test_golden_is_structurally_valid() -> None:
    assert validate(Program.from_json(GOLDEN / "two_layer_chain.json")) == []


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.name)
def test_every_golden_file_round_trips(path: Path) -> None:
    program = Program.from_json(path)
    assert Program.from_json(program.to_json()) == program
