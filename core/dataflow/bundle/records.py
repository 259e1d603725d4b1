"""An exported run: what was planned, what the simulator predicts, what was measured.

A bundle is a folder of JSON files, each with a versioned ``format`` key (program.json
carries the Program's own ``schema`` envelope instead):

- ``program.json``: the exact annotated Program (``Program.to_json``);
- ``plan.json``: the plan (``PlanRecord``): planner, budgets, the directives per task, the
  recomputed units, and the placement (an offset for every block of fast memory);
- ``timeline.json``: the predicted Timeline (``dataflow.timeline.wire``);
- ``summary.json``: the figures of one step (``Summary``);
- ``measured_timeline.json`` (optional): the measured Timeline of real steps, in the
  same format as the predicted one.

``write_bundle(folder, bundle)`` writes them; ``read_bundle(folder)`` reads them back and
fails with a ``BundleError`` that names the file at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs

from dataflow.schema import Program, SchemaError
from dataflow.timeline import Timeline
from dataflow.timeline.wire import (
    CONVERTER,
    FORMAT_KEY,
    TimelineFormatError,
    describe,
    timeline_from_dict,
    timeline_to_dict,
)

PLAN_FORMAT = "dataflow.bundle.plan/v1"
SUMMARY_FORMAT = "dataflow.bundle.summary/v1"
PROGRAM_FILE = "program.json"
PLAN_FILE = "plan.json"
TIMELINE_FILE = "timeline.json"
SUMMARY_FILE = "summary.json"
MEASURED_FILE = "measured_timeline.json"


class BundleError(ValueError):
    """A bundle file that is missing or is not what it should be; names the file."""


@attrs.frozen
class Directives:
    """What fires when a task (or the prologue) completes."""

    releases: tuple[str, ...] = ()
    offloads: tuple[str, ...] = ()
    prefetches: tuple[str, ...] = ()


@attrs.frozen
class PlacedBlock:
    """One stretch of fast memory at its arena offset: ``obj_id``'s bytes, or
    ``task_id``'s workspace, live over ``[start_us, end_us)`` of the predicted step."""

    offset_bytes: int
    size_bytes: int
    start_us: float
    end_us: float
    obj_id: str | None = None
    task_id: str | None = None


@attrs.frozen
class PlacementRecord:
    """The arena: its size, the most bytes live at once, and every block's offset;
    ``workspace_outside_bytes``: task workspace left to the device allocator beside it."""

    arena_bytes: int
    peak_bytes: int
    workspace_outside_bytes: int = 0
    blocks: tuple[PlacedBlock, ...] = ()


@attrs.frozen
class PlanRecord:
    """The annotated plan. ``budget_bytes`` is the budget the placement was asked to fit
    (on CUDA the device libraries' reserve is already taken off it), ``planned_budget_bytes``
    the one the plan was made at (smaller when placement had to re-plan); ``step_us`` one
    step (a cyclic plan's steady-state iteration), ``makespan_us`` the simulated run;
    ``recomputed`` the units whose saved values are re-derived (``round:layer``, training
    plans; ``round:layer:name`` where only partial save ``name``'s part is); ``directives`` per task id (and ``<prologue>``), only those with any."""

    planner: str
    budget_bytes: int
    planned_budget_bytes: int
    slow_budget_bytes: int | None
    cyclic: bool
    step_us: float
    makespan_us: float
    lower_bound_us: float
    directives: dict[str, Directives]
    placement: PlacementRecord | None = None
    recomputed: tuple[str, ...] = ()


@attrs.frozen
class Measured:
    """What real steps measured: the median step (``step_s``; replayed steps' where a CUDA
    graph replayed them), tokens a second, the ledger's and (CUDA) the allocator's peak,
    how many steps and on what device."""

    step_s: float
    steps: int
    device: str
    fast_peak_bytes: int
    tok_s: float | None = None
    allocator_peak_bytes: int | None = None
    replayed: bool = False


@attrs.frozen
class Summary:
    """One step's figures (``dataflow predict``'s row names where they exist);
    ``budget_bytes`` the whole fast budget asked for.

    ``pricing`` says where task costs came from: ``profile cache`` (measured earlier, read
    from the cache), ``profiled`` (measured now), ``roofline`` (of the ``hw`` entry) or
    ``program`` (the costs the program file carried). ``moved_bytes`` and
    ``link_busy_pct`` are per link; ``shape`` the training step's (batch, seq_len,
    rounds, tokens, dtype) where the program is one."""

    step_s: float
    fast_peak_bytes: int
    backing_peak_bytes: int
    budget_bytes: int
    backing_budget_bytes: int | None
    moved_bytes: dict[str, int]
    link_busy_pct: dict[str, float]
    compute_idle_pct: float
    recompute_pct: float
    lower_bound_s: float
    planner: str
    pricing: str
    hw: str | None = None
    family: str | None = None
    preset: str | None = None
    shape: dict[str, Any] = attrs.field(factory=dict)
    tokens_step: int | None = None
    tok_s: float | None = None
    effective_tflops: float | None = None
    hardware_tflops: float | None = None
    recomputed_layers: tuple[str, ...] = ()
    measured: Measured | None = None


@attrs.frozen
class Bundle:
    """A bundle in memory (module docstring); ``measured`` is None until real steps ran."""

    program: Program = attrs.field(eq=False)
    plan: PlanRecord
    timeline: Timeline
    summary: Summary
    measured: Timeline | None = None


def write_bundle(folder: str | Path, bundle: Bundle) -> Path:
    """Write ``bundle``'s files into ``folder`` (made when missing); return the folder. A
    ``measured_timeline.json`` already there is kept unless the bundle has its own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PROGRAM_FILE).write_text(bundle.program.to_json())
    _write_json(folder / PLAN_FILE, {FORMAT_KEY: PLAN_FORMAT, **CONVERTER.unstructure(bundle.plan)})
    _write_json(folder / TIMELINE_FILE, timeline_to_dict(bundle.timeline))
    summary = {FORMAT_KEY: SUMMARY_FORMAT, **CONVERTER.unstructure(bundle.summary)}
    _write_json(folder / SUMMARY_FILE, summary)
    if bundle.measured is not None:
        write_measured(folder, bundle.measured)
    return folder


def write_measured(folder: str | Path, timeline: Timeline) -> Path:
    """Write the measured timeline beside a bundle (``measured_timeline.json``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return _write_json(folder / MEASURED_FILE, timeline_to_dict(timeline))


def _write_json(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(json.dumps(document, separators=(",", ":")))
    return path


def read_bundle(folder: str | Path) -> Bundle:
    """The bundle in ``folder``; ``BundleError`` naming the file that is missing, is not
    JSON, has another format or a field that is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"{folder}: not a folder (a bundle is a folder of JSON files)")
    program_path = folder / PROGRAM_FILE
    if not program_path.exists():
        raise _missing(program_path)
    try:  # read within the program file's bounds (dataflow.schema.program_file)
        program = Program.from_json(program_path)
    except SchemaError as exc:
        problems = "; ".join(exc.problems)
        raise BundleError(f"{program_path}: not a valid program: {problems}") from None
    measured_path = folder / MEASURED_FILE
    return Bundle(
        program=program,
        plan=_record(folder / PLAN_FILE, PlanRecord, PLAN_FORMAT),
        timeline=_timeline(folder / TIMELINE_FILE),
        summary=_record(folder / SUMMARY_FILE, Summary, SUMMARY_FORMAT),
        measured=_timeline(measured_path) if measured_path.exists() else None,
    )


def _missing(path: Path) -> BundleError:
    return BundleError(f"{path}: missing (write the bundle with `dataflow export`)")


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc.strerror})") from None


def _json(path: Path) -> Any:
    try:
        return json.loads(_text(path))
    except ValueError as exc:
        raise BundleError(f"{path}: not JSON ({exc})") from None


def _timeline(path: Path) -> Timeline:
    try:
        return timeline_from_dict(_json(path), str(path))
    except TimelineFormatError as exc:
        raise BundleError(str(exc)) from None


def _record(path: Path, kind: type, expected: str) -> Any:
    data = _json(path)
    if not isinstance(data, Mapping):
        raise BundleError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get(FORMAT_KEY) != expected:
        raise BundleError(
            f"{path}: format is {data.get(FORMAT_KEY)!r}; this version reads {expected!r}"
        )
    try:
        return CONVERTER.structure({k: v for k, v in data.items() if k != FORMAT_KEY}, kind)
    except cattrs.BaseValidationError as exc:
        raise BundleError(f"{path}: {'; '.join(describe(exc))}") from None
