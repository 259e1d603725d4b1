"""Golden plans: small chains whose planned programs are checked in.

Each ``tests/planning/golden/*.json`` holds a bare program, the budget, and what PressureFit
made of it: the planned program, its makespan and the lower bound. A change that alters
any of them fails here and must say why in its commit. To accept the new plans, run::

    DATAFLOW_REGENERATE_GOLDEN=1 python -m pytest tests/planning/test_golden.py

and review the diff of the JSON files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dataflow.planning import plan
from dataflow.schema import Program
from dataflow.testing.shapes import MiB, mutate_and_reuse, tiny_streaming, tiny_training

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("DATAFLOW_REGENERATE_GOLDEN") == "1"

#: name -> (chain, fast budget)
CASES = {
    "tiny_training_tight": (tiny_training, 18 * MiB),
    "tiny_training_roomy": (tiny_training, 30 * MiB),
    "tiny_streaming_two_weights": (tiny_streaming, 20 * MiB),
    "mutate_and_reuse": (mutate_and_reuse, 16 * MiB),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan(name: str) -> None:
    make, budget = CASES[name]
    program = make()
    planned = plan(program, budget)
    document = {
        "budget_bytes": budget,
        "makespan_us": planned.makespan_us,
        "lower_bound_us": planned.lower_bound_us,
        "program": program.to_dict(),
        "planned": planned.program.to_dict(),
    }
    path = GOLDEN / f"{name}.json"
    if REGENERATE:
        path.write_text(json.dumps(document, indent=1) + "\n")
    expected = json.loads(path.read_text())
    assert Program.from_dict(expected["program"]) == program, "the chain itself changed"
    assert expected["budget_bytes"] == budget
    assert planned.program == Program.from_dict(expected["planned"]), (
        f"the plan of {name} changed; if that is intended, regenerate (see the module docstring)"
    )
    assert planned.makespan_us == expected["makespan_us"]
    assert planned.lower_bound_us == expected["lower_bound_us"]
