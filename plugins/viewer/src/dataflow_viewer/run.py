"""What the viewer shows: one planned program, its predicted timeline and, when there is
one, the measured timeline of a real step (``Run``).

A run comes from a folder ``dataflow export`` wrote (``dataflow_viewer.bundle``), or is
made here: ``lower_preset`` lowers a family preset at a training shape, ``predict``
plans a bare program into a budget and simulates it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

import attrs
import click

from dataflow import Program, Timeline, place, plan, predicted_timeline
from dataflow.cli import COUNT, lookup, one_line

PREDICTED, MEASURED = "predicted", "measured"
#: ``dataflow lower --dtype``
DTYPES = click.Choice(["fp32", "bf16"])
T = TypeVar("T")


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


def checked(field: str, check: Callable[..., T], *args: Any) -> T:
    """``check(*args)``, one of the ``dataflow`` command line's own option checks; the usage
    error it raises becomes a ``ViewerError`` naming the field: the option it names
    (``--seq-len``: ``seq_len``), else ``field``. So the viewer checks what the command
    line checks, with the same code."""
    try:
        return check(*args)
    except click.ClickException as exc:
        hint = exc.param_hint if isinstance(exc, click.BadParameter) else None
        if isinstance(hint, str) and hint.startswith("--"):
            field = hint.removeprefix("--").replace("-", "_")
        raise ViewerError(f"{field}: {one_line(exc.message)}") from None


def planner_spec(name: str) -> Any:
    """The installed planner ``name``, or an error naming the installed ones."""
    from dataflow import planners

    return checked("planner", lookup, planners(), name, "--planner")


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
    preset: str,
    *,
    batch: int,
    seq_len: int,
    rounds: int = 1,
    dtype: str = "fp32",
    family: str | None = None,
) -> Program:
    """The bare Program of one training step of ``preset`` (of ``family``; default: the
    one installed family that has it) at this training shape, each value checked by the
    checks ``dataflow lower`` runs on its option of that name (``--seq-len`` at most the
    preset's longest sequence, ...); a bad one raises ``ViewerError`` naming it."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("rounds", rounds)):
        checked(name, COUNT.convert, value, None, None)
    checked("dtype", DTYPES.convert, dtype, None, None)
    return _lowered(preset, family, batch, seq_len, rounds, dtype)


@lru_cache(maxsize=16)
def _lowered(
    preset: str, family: str | None, batch: int, seq_len: int, rounds: int, dtype: str
) -> Program:
    from dataflow_training import DtypePolicy, TrainConfig, check_preset, lower

    _, loaded, _ = checked("preset", check_preset, preset, family, seq_len)
    train = TrainConfig(seq_len=seq_len, batch=batch, rounds=rounds, dtype=DtypePolicy.named(dtype))
    try:
        return lower(loaded, preset, train).program
    except ValueError as exc:
        raise ViewerError(f"preset {preset!r}: {' '.join(str(exc).split())}") from None
