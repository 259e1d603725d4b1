"""Bundles of training steps (``dataflow export --preset``, ``dataflow train --trace-steps``).

``export_cell`` plans a ``predict`` cell as ``dataflow predict`` does (its ``plan_cell``),
with the training step ``dataflow train`` would run, but as one run of the step (weights
and optimizer state from slow memory back to slow memory, not the steady-state cycle
``predict`` plans), so that the bundle's timeline is the one its program simulates to;
it places it, and
returns the bundle (``dataflow.bundle``): the program, the plan and placement, the
predicted timeline, and a summary whose figures are ``predict``'s row of the placed plan.

``run_bundle`` is the same for a ``TrainingRun``: the plan its engine runs, priced as the
run priced it, with the measured timeline of the steps it traced (``traced_timeline``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from dataflow import (
    Bundle,
    Measured,
    PlanningError,
    Summary,
    bundle_of,
    measured_timeline,
    place,
    plan_summary,
)
from dataflow_training.plan.hardware import HardwareEntry
from dataflow_training.plan.predict import Cell, plan_cell, recomputed, row_of
from dataflow_training.plan.pricing import declared_for
from dataflow_training.step.config import TrainConfig


class ExportError(ValueError):
    """A cell that cannot be exported: the reason it cannot run."""


def shape_of(train: TrainConfig, tokens_step: int) -> dict[str, Any]:
    return {
        "batch": train.batch,
        "seq_len": train.seq_len,
        "rounds": train.rounds,
        "t_round": train.batch * train.seq_len,
        "tokens_step": tokens_step,
        "dtype": attrs.asdict(train.dtype),
    }


def summary_of(
    placement: Any,
    step: Any,
    cell: Cell,
    train: TrainConfig,
    *,
    pricing: str,
    hw: str | None,
    family_name: str,
    measured: Measured | None = None,
) -> Summary:
    """The bundle summary of a placed training step (``step``: the placed plan's program
    with its layout): ``predict``'s row of the plan the placement packed, with the
    step's shape and where its costs came from."""
    row = row_of(placement.plan, step, cell, {})
    return plan_summary(
        placement,
        pricing,
        hw=hw,
        family=family_name,
        preset=cell.preset,
        shape=shape_of(train, cell.tokens_step),
        tokens_step=cell.tokens_step,
        tok_s=row["tok_s"],
        effective_tflops=row["effective_tflops"],
        hardware_tflops=row["hardware_tflops"],
        recompute_pct=row["recompute_pct"],
        compute_idle_pct=row["compute_idle_pct"],
        recomputed_layers=tuple(row["recomputed_layers"]),
        budget_bytes=cell.budget_bytes,
        measured=measured,
    )


def export_cell(
    family: Any,
    family_name: str,
    cell: Cell,
    hw: HardwareEntry,
    train: TrainConfig,
    *,
    recompute: bool = True,
    measure: Any = None,
    reserve_bytes: int = 0,
    pricing: str = "roofline",
) -> Bundle:
    """The bundle of one cell (module docstring); ``ExportError`` when it cannot run.
    With ``measure`` (priced by the profiling pass) task workspace stays beside the arena,
    as the engine runs it on CUDA."""

    planned = plan_cell(
        family,
        cell,
        hw,
        recompute=recompute,
        train=train,
        measure=measure,
        reserve_bytes=reserve_bytes,
        cyclic=False,  # the bundle's timeline is the one run its program simulates to
    )
    if planned.reason is not None:
        raise ExportError(planned.reason)
    try:
        placement = place(planned.planned, workspace_beside_bytes=planned.workspace_beside_bytes)
    except PlanningError as exc:
        raise ExportError(" ".join(str(exc).split())) from None
    step = planned.step_of(placement.plan.program)
    summary = summary_of(
        placement,
        step,
        cell,
        train,
        pricing=pricing,
        hw=None if pricing in ("profile cache", "profiled") else hw.name,
        family_name=family_name,
    )
    return bundle_of(placement, summary, recomputed=recomputed(step))


def run_cell(run: Any) -> Cell:
    """The ``predict`` cell of a ``TrainingRun``'s step."""
    compiled, train = run.compiled, run.train
    t_round = train.batch * train.seq_len
    return Cell(
        compiled.preset, t_round, train.seq_len, t_round * train.rounds, compiled.budget_bytes
    )


def traced_timeline(run: Any, results: Sequence[Any], predicted: Any) -> Any:
    """The measured timeline of the steps in ``results`` (each a step's ``RunResult``)."""
    steps = [result.to_timeline() for result in results]
    device = {"device": run.device, "graph": run.compiled.graph, "graph_note": run.graph_note}
    return measured_timeline(run.compiled.program, steps, predicted, metadata=device)


def measured_step(run: Any, makespans: Sequence[tuple[float, bool]], results: Sequence[Any]):
    """The measured step of a run (``Measured``) from every step's ``(makespan_us,
    replayed)``: the median of the replayed steps where a CUDA graph replayed any (what
    training runs at), else of the dispatched steps after the first (which warms up)."""
    replayed = [us for us, was_replayed in makespans if was_replayed]
    chosen = replayed or [us for us, _ in makespans[1:]] or [us for us, _ in makespans]
    step_s = statistics.median(chosen) / 1e6
    peaks = [r.allocator_peak_bytes for r in results if r.allocator_peak_bytes is not None]
    return Measured(
        step_s=step_s,
        steps=len(chosen),
        device=run.device,
        fast_peak_bytes=max((r.fast_peak_bytes for r in results), default=0),
        tok_s=run_cell(run).tokens_step / step_s if step_s > 0 else None,
        allocator_peak_bytes=max(peaks) if peaks else None,
        replayed=bool(replayed),
    )


def run_bundle(
    run: Any,
    results: Sequence[Any] = (),
    makespans: Sequence[tuple[float, bool]] = (),
    *,
    pricing: str = "",
) -> Bundle:
    """The bundle of a ``TrainingRun``: its placed plan, priced as the run priced it
    (the profiling pass, or a cost model the run was compiled with), and, when
    ``results`` (the traced steps' ``RunResult``, dispatched) are given, their measured
    timeline; ``makespans`` every step's ``(makespan_us, replayed)`` for the measured
    step (``measured_step``)."""
    measured = measured_step(run, makespans, results) if makespans else None
    compiled = run.compiled
    declared = compiled.priced_for == declared_for(compiled.device)
    pricing = pricing or ("roofline" if declared else "profiled")
    summary = summary_of(
        compiled.placement,
        compiled.running,
        run_cell(run),
        run.train,
        pricing=pricing,
        hw=None,
        family_name=compiled.family.name,
        measured=measured,
    )
    bundle = bundle_of(compiled.placement, summary, recomputed=recomputed(compiled.running))
    if not results:
        return bundle
    return attrs.evolve(bundle, measured=traced_timeline(run, results, bundle.timeline))
