"""What the viewer shows: one planned program, its predicted timeline and, when there is
one, the measured timeline of a real step (``Run``).

A run comes from a folder ``dataflow export`` wrote (``dataflow_viewer.bundle``), or is
made here: ``lower_preset`` lowers a family preset at a training shape, ``predict``
plans a bare program into a budget and simulates it.
"""

from __future__ import annotations

from typing import Any

import attrs

from dataflow import Program, Timeline, place, plan, predicted_timeline

PREDICTED, MEASURED = "predicted", "measured"


class ViewerError(ValueError):
    """Input the viewer cannot show; the message is one line naming the file or option."""


@attrs.frozen
class Run:
    """A planned ``program`` (directives written), its prediction and maybe a measurement.

    ``budget_bytes`` is the fast budget it was planned for; ``planner`` the planner's name
    (empty when unknown); ``source`` says where it came from, for page titles;
    ``summary`` is the bundle's ``dataflow.bundle.Summary`` where the run came from one.
    """

    program: Program
    predicted: Timeline
    measured: Timeline | None = None
    budget_bytes: int | None = None
    planner: str = ""
    source: str = ""
    summary: Any = None

    @property
    def timelines(self) -> dict[str, Timeline]:
        """``{"predicted": ..., "measured": ...}``, the measured one only when present."""
        found = {PREDICTED: self.predicted}
        if self.measured is not None:
            found[MEASURED] = self.measured
        return found

    def with_measured(self, measured: Timeline | None) -> Run:
        return attrs.evolve(self, measured=measured)


def planner_spec(name: str) -> Any:
    """The installed planner ``name``, or an error naming the installed ones."""
    from dataflow import planners

    registry = planners()
    names = sorted(spec.name for spec in registry)
    if name not in names:
        raise ViewerError(f"planner {name!r} is not installed; installed: {', '.join(names)}")
    return registry.get(name)


def predict(
    program: Program, budget_bytes: int, planner: str = "pressurefit", source: str = ""
) -> Run:
    """Plan the bare chain of ``program`` into ``budget_bytes`` with ``planner``, place
    it and simulate it: the predicted timeline is the one ``dataflow export`` writes
    (``dataflow.bundle.predicted_timeline``: memory by role, link rates, stalls).
    Planning and placement errors pass through."""
    planned = plan(program, budget_bytes, planner=planner_spec(planner))
    placement = place(planned)  # may re-plan below the budget when fragmentation needs it
    return Run(
        program=placement.plan.program,
        predicted=predicted_timeline(placement, PREDICTED),
        budget_bytes=budget_bytes,
        planner=planner,
        source=source or program.name,
    )


def preset_family(preset: str) -> tuple[str, Any]:
    """``(name, family)`` of the one installed family that has ``preset``."""
    from dataflow import families

    owners, known = [], []
    for spec in families():
        try:
            presets = getattr(spec.load(), "presets", None) or {}
        except Exception:  # a broken family plugin owns nothing (`dataflow plugins list`)
            continue
        known += list(presets)
        if preset in presets:
            owners.append((spec.name, spec.load()))
    if len(owners) != 1:
        why = "no installed family has it" if not owners else "several families have it"
        raise ViewerError(f"preset {preset!r}: {why}; known presets: {', '.join(sorted(known))}")
    return owners[0]


def presets() -> list[str]:
    """Every preset of every installed family, sorted."""
    from dataflow import families

    found = []
    for spec in families():
        try:
            found += list(getattr(spec.load(), "presets", None) or {})
        except Exception:
            continue
    return sorted(found)


def lower_preset(
    preset: str, *, batch: int, seq_len: int, rounds: int = 1, dtype: str = "fp32"
) -> Program:
    """The bare Program of one training step of ``preset`` at this training shape."""
    from dataflow_training import DtypePolicy, TrainConfig, lower

    for name, value in (("batch", batch), ("seq_len", seq_len), ("rounds", rounds)):
        if not isinstance(value, int) or value < 1:
            raise ViewerError(f"{name} must be a whole number >= 1, not {value!r}")
    if dtype not in ("fp32", "bf16"):
        raise ViewerError(f"dtype must be fp32 or bf16, not {dtype!r}")
    _, family = preset_family(preset)
    train = TrainConfig(seq_len=seq_len, batch=batch, rounds=rounds, dtype=DtypePolicy.named(dtype))
    try:
        return lower(family, preset, train).program
    except ValueError as exc:
        raise ViewerError(f"preset {preset!r}: {' '.join(str(exc).split())}") from None
