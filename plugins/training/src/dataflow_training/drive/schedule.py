"""The learning-rate schedule of a run: a value its checkpoints keep, so that a resume
goes on with the schedule the run had, not one recomputed from its options.

A schedule is one or more phases. A phase starts at an update (0-based), warms up
linearly over ``warmup`` updates to ``lr``, then follows its shape to its ``end``:
``cosine`` (down to ``min_lr_ratio * lr`` at its last update), ``wsd`` (stable, then a
linear decay over the last ``WSD_DECAY_FRACTION`` of the updates after warmup, to the same
floor) or ``constant``. Past its end a phase holds the lr of its last update: a constant
tail, so the lr never jumps where a run goes on past the end of its schedule.

A run starts with one phase over its ``--steps``. Resumed with another ``--steps``, the
schedule stays as it was (``resumed``): a longer run goes on at the lr the schedule ended
on (or follows the rest of the schedule first, then holds), a shorter one stops partway.
``--reset-schedule`` instead starts a new phase at the resumed update, over the rest of the
new ``--steps``, with the ``--lr``, ``--warmup``, ``--schedule`` and ``--min-lr-ratio``
given (the run's where not given). Without it, any of those that differs from the
schedule's is refused, naming the option and the flag. See docs/checkpointing.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

SCHEDULES = ("cosine", "wsd", "constant")
#: the share of a phase's updates after warmup that WSD spends decaying (the rest is stable)
WSD_DECAY_FRACTION = 0.2
#: the TrainOptions fields that shape a phase, and the option that sets each
SHAPE_OPTIONS = {
    "lr": "--lr",
    "warmup": "--warmup",
    "schedule": "--schedule",
    "min_lr_ratio": "--min-lr-ratio",
}
RESET_FLAG = "--reset-schedule"


class ScheduleChange(ValueError):
    """A resume asked for another schedule than its run's without ``--reset-schedule``."""


@attrs.frozen
class Phase:
    """Updates ``start`` .. ``end - 1`` (0-based) of one schedule shape; past ``end`` it
    holds the lr of update ``end - 1``."""

    start: int
    end: int
    lr: float
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1

    def __attrs_post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")

    @classmethod
    def of(cls, options: Any, start: int, end: int) -> Phase:
        """The phase of ``options`` (a TrainOptions, or its manifest mapping) over
        updates ``start`` .. ``end - 1``."""
        get = options.get if isinstance(options, Mapping) else lambda k: getattr(options, k)
        return cls(start, end, **{name: get(name) for name in SHAPE_OPTIONS})

    def lr_at(self, step: int) -> float:
        """The lr of 0-based update ``step`` (at or after ``start``)."""
        step = min(step, self.end - 1) - self.start  # past the end: the last update's lr
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        floor = self.lr * self.min_lr_ratio
        span = max(1, self.end - self.start - self.warmup - 1)
        done = min(1.0, (step - self.warmup) / span)
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "cosine":
            return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * done))
        stable = 1 - WSD_DECAY_FRACTION  # wsd
        if done <= stable:
            return self.lr
        return self.lr - (self.lr - floor) * (done - stable) / (1 - stable)

    def describe(self) -> str:
        """``warmup over 2 step(s) to lr 0.002, then cosine to 0.0002 at step 10``."""
        floor = f"{self.lr * self.min_lr_ratio:.3g} at step {self.end}"
        shape = "constant" if self.schedule == "constant" else f"{self.schedule} to {floor}"
        if not self.warmup:
            return f"lr {self.lr:.3g}, {shape}"
        return f"warmup over {self.warmup} step(s) to lr {self.lr:.3g}, then {shape}"


@attrs.frozen
class LrSchedule:
    """A run's phases, in order of ``start``; the last one goes on past its end."""

    phases: tuple[Phase, ...] = attrs.field(converter=tuple, validator=attrs.validators.min_len(1))

    @classmethod
    def of(cls, options: Any) -> LrSchedule:
        """The one phase of a new run of ``options`` over its ``steps``."""
        return cls((Phase.of(options, 0, options.steps),))

    @classmethod
    def from_json(cls, data: Sequence[Mapping[str, Any]]) -> LrSchedule:
        return cls(Phase(**phase) for phase in data)

    def to_json(self) -> list[dict[str, Any]]:
        return [attrs.asdict(phase) for phase in self.phases]

    @property
    def end(self) -> int:
        return self.phases[-1].end

    def lr_at(self, step: int) -> float:
        """The lr of 0-based update ``step``."""
        phase = next(p for p in reversed(self.phases) if p.start <= step or p is self.phases[0])
        return phase.lr_at(step)


def stored_schedule(manifest: Mapping[str, Any], options: Any) -> LrSchedule:
    """The schedule of the run that wrote ``manifest``: its ``schedule``, or for a
    checkpoint written before schedules were kept, the one phase of its options (``options``
    where it has none)."""
    if "schedule" in manifest:
        return LrSchedule.from_json(manifest["schedule"])
    theirs = manifest.get("options")
    if isinstance(theirs, Mapping) and all(k in theirs for k in (*SHAPE_OPTIONS, "steps")):
        return LrSchedule((Phase.of(theirs, 0, theirs["steps"]),))
    return LrSchedule.of(options)


def resumed(
    stored: LrSchedule, options: Any, start: int, reset: bool
) -> tuple[LrSchedule, str | None]:
    """The schedule a run of ``options`` resumed at update ``start`` follows, and the
    ``resume:`` line that says what it does where that is not plain continuation (None
    otherwise). Without ``reset`` the stored schedule goes on, and an option of
    ``SHAPE_OPTIONS`` that differs from its last phase's is a ``ScheduleChange`` naming
    the option and ``RESET_FLAG``; with it a new phase starts at ``start``."""
    last = stored.phases[-1]
    steps = options.steps
    if reset:
        kept = tuple(p for p in stored.phases if p.start < start)
        if steps <= start:  # nothing left to train: nothing to reset
            return stored, None
        phase = Phase.of(options, start, steps)
        new = LrSchedule(kept + (phase,))
        changed = [
            f"{name} {getattr(last, name)} -> {getattr(phase, name)}"
            for name in SHAPE_OPTIONS
            if getattr(last, name) != getattr(phase, name)
        ]
        what = f"changed: {', '.join(changed)}" if changed else "same options"
        return new, (
            f"resume: {RESET_FLAG}: a new schedule from step {start + 1} to {steps}: "
            f"{phase.describe()} (the lr was {stored.lr_at(start - 1):.3g} at step {start}; "
            f"{what})"
        )
    for name, option in SHAPE_OPTIONS.items():
        theirs, ours = getattr(last, name), getattr(options, name)
        if theirs != ours:
            raise ScheduleChange(
                f"{option} {ours} is not the resumed run's {theirs}: a resumed run keeps its "
                f"learning-rate schedule; pass {RESET_FLAG} to start a new one at step "
                f"{start + 1}"
            )
    if steps == stored.end or steps <= start:  # as it was, or nothing left to train
        return stored, None
    hold = stored.lr_at(stored.end - 1)
    if steps > stored.end:
        follows = "" if start >= stored.end else f"follows it to step {stored.end}, then "
        return stored, (
            f"resume: --steps {steps} goes past the end of the run's schedule (step "
            f"{stored.end}): the lr {follows}stays at {hold:.3g}, where the schedule ends, "
            f"without a jump ({RESET_FLAG} starts a new schedule to step {steps} instead)"
        )
    return stored, (
        f"resume: --steps {steps} stops before the end of the run's schedule (step "
        f"{stored.end}): the lr follows it and is {stored.lr_at(steps - 1):.3g} at step "
        f"{steps}, not the {hold:.3g} it ends on ({RESET_FLAG} for a schedule that ends at "
        f"step {steps})"
    )
