"""Memory for reading, validating and planning a program stays proportional to it: the
probe of docs/program_schema.md's bytes per task (``benchmarks/probes/program_memory.py``),
run at moderate sizes against a bound of about twice what it measured. A structure
quadratic in the tasks would pass the bound there: 8 bytes a pair of tasks is 80 KiB a task
at 10,000 tasks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.probes.program_memory import chain_file, measure

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the probe reads Linux's /proc/self/status"
)

#: (phase, tasks, bound in bytes a task): measured 3,400 (validate) and 5,100 (plan)
#: bytes a task at 1e4 and 1e5 tasks (benchmarks/results/program_memory.json).
CASES = [("validate", 10_000, 7_000), ("plan", 3_000, 10_000)]


@pytest.mark.parametrize(("phase", "tasks", "bound"), CASES, ids=[c[0] for c in CASES])
def test_memory_per_task_is_bounded(tmp_path: Path, phase: str, tasks: int, bound: int) -> None:
    path, budget = chain_file(tasks, tmp_path)
    row = measure(path, phase, budget)
    assert row["tasks"] >= tasks - 5
    assert 0 < row["bytes_per_task"] < bound, row
