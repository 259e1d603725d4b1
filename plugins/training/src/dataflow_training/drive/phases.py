"""Training phases: what trains changes at step boundaries (``dataflow train --phase``).

A run's phases are its ``freeze`` from step 0 and then each ``Phase(start, freeze)``:
from ``start`` steps done on, the parameters ``freeze`` names (``step.freezing``) do not
train. "Train the head for 100 steps, then everything" is ``--freeze embed --freeze
layers --phase 100:``. Each phase is its own compiled step (lowered, planned and placed
once, when the run reaches it). At a boundary the weights carry over as they are; the
optimizer state of every tensor that trains in both phases carries over, a tensor that
starts training starts from zero moments (the optimizer's update count goes on), and a
tensor that stops training drops its state. The state goes through the same copy as a
checkpoint and its resume, so a run resumed across a boundary is bit-identical to one
that was not stopped. Checkpoints record the phase (``phase`` in the manifest); a resume
compiles the phase its step falls in and refuses a checkpoint of another.

The command line takes ``START:PATTERNS`` (``100:`` or ``100:embed,layers.0-3``): a few
phases, each one flag, kept with the run's other options in its checkpoints, so a resume
needs no file beside the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from dataflow_training.drive.run import TrainingRun
from dataflow_training.drive.values import state_layouts
from dataflow_training.step.family import LayerSpec
from dataflow_training.step.freezing import FreezeError, freeze_layers
from dataflow_training.step.lowering import Lowered


@attrs.frozen
class Phase:
    """From ``start`` steps done on, the parameters ``freeze`` names do not train."""

    start: int
    freeze: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @classmethod
    def parse(cls, text: str) -> Phase:
        """``START:PATTERNS`` (patterns comma-separated, none: everything trains); a
        ValueError names the text otherwise."""
        start, colon, patterns = str(text).partition(":")
        if not colon or not start.strip().isdigit() or int(start) < 1:
            raise ValueError(
                f"--phase {text}: give START:PATTERNS, START the steps done before it (>= 1) "
                "and PATTERNS what it freezes, comma-separated (none: everything trains), "
                "e.g. 100: or 100:embed,layers.0-3"
            )
        return cls(int(start), tuple(p.strip() for p in patterns.split(",") if p.strip()))

    @classmethod
    def of(cls, value: Phase | str | Mapping[str, Any]) -> Phase:
        """A phase as given: itself, the command line's text, or the mapping a
        checkpoint's options record."""
        if isinstance(value, Phase):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        return cls(int(value["start"]), tuple(value["freeze"]))

    def describe(self) -> str:
        frozen = ", ".join(self.freeze) or "nothing"
        return f"from step {self.start + 1}: frozen {frozen}"


def phases_of(values: Iterable[Phase | str | Mapping[str, Any]]) -> tuple[Phase, ...]:
    """``TrainOptions.phases`` as given, in order of their starts; two at one step is a
    ValueError naming it."""
    phases = sorted((Phase.of(v) for v in values), key=lambda p: p.start)
    for before, after in zip(phases, phases[1:], strict=False):
        if before.start == after.start:
            raise ValueError(f"--phase: two phases start at step {after.start}")
    return tuple(phases)


def run_phases(freeze: tuple[str, ...], phases: Iterable[Phase]) -> tuple[Phase, ...]:
    """Every phase of a run: ``freeze`` from step 0, then ``phases``."""
    return (Phase(0, freeze), *phases)


def check_phases(phases: tuple[Phase, ...], layers: Sequence[LayerSpec]) -> None:
    """Every phase's patterns checked against the model's ``layers`` before the run
    starts, so a typo in a late phase is said at once (``FreezeError``)."""
    for phase in phases:
        try:
            freeze_layers(layers, phase.freeze)
        except FreezeError as exc:
            if phase.start == 0:  # the run's --freeze
                raise
            raise FreezeError(f"--phase {phase.start}:{','.join(phase.freeze)}: {exc}") from None


def phase_at(phases: tuple[Phase, ...], done: int) -> int:
    """The index of the phase of the step after ``done`` steps."""
    return max(i for i, phase in enumerate(phases) if phase.start <= done)


class PhasedRun:
    """A run over its phases: the ``TrainingRun`` of the phase under way (``current``),
    replaced by the next phase's at its first step. ``compile(freeze)`` compiles the
    step of a phase (the run's shape, budget and device, with that freeze); ``say``
    gets a line at each boundary."""

    def __init__(
        self,
        current: TrainingRun,
        phases: tuple[Phase, ...],
        compile: Callable[[tuple[str, ...]], Any],
        say: Callable[[str], None],
        plan_line: Callable[[Any], str],
    ) -> None:
        self.current, self.phases, self.compile, self.say = current, phases, compile, say
        self.plan_line = plan_line
        self.index = phase_at(phases, current.updates)

    @property
    def compiled(self) -> Any:
        return self.current.compiled

    @property
    def last_result(self) -> Any:
        return self.current.last_result

    def step(self, batches: Any, lr: float | None = None, *, dispatch: bool = False) -> Any:
        """``TrainingRun.step`` of the phase the step falls in."""
        index = phase_at(self.phases, self.current.updates)
        if index != self.index:
            self._enter(index)
        return self.current.step(batches, lr, dispatch=dispatch)

    def save(self, path: Any, extra: Mapping[str, Any] | None = None) -> Any:
        """A checkpoint of the phase under way, which its manifest records."""
        return self.current.save(path, {**dict(extra or {}), "phase": self.index})

    def close(self, keep_state: bool = True) -> None:
        self.current.close(keep_state=keep_state)

    def _enter(self, index: int) -> None:
        old = self.current
        old.close()  # its device memory given back, its state kept on the host: a compile
        # that fails leaves the run as it was
        weights, opt = old.state()
        compiled = self.compile(self.phases[index].freeze)
        new = TrainingRun(compiled, seed=old.seed, state=weights)
        new.set_state(
            weights, carried_state(old.compiled.running, opt, compiled.running), old.updates
        )
        self.current, self.index = new, index
        self.say(f"phase {index + 1} of {len(self.phases)}, {self.phases[index].describe()}")
        self.say(self.plan_line(compiled))


def carried_state(
    old: Lowered, opt: Mapping[str, torch.Tensor], new: Lowered
) -> dict[str, torch.Tensor]:
    """The optimizer state of ``new``'s step (raw bytes by ``O`` object, laid out for the
    model state: ``values.state_layouts``) from ``opt``, ``old``'s: every entry
    (``<param>/<field>`` of a layer) both steps keep is copied, the others are zeros; an
    object laid out alike in both is taken whole."""
    entries: dict[str, torch.Tensor] = {}
    was = state_layouts(old)
    for obj_id, layout in was.items():
        layer = old.layout.packed[obj_id].layer
        for name, view in layout.views(opt[obj_id]).items():
            entries[f"{layer}.{name}"] = view
    out = {}
    for obj_id, layout in state_layouts(new).items():
        if was.get(obj_id) == layout:  # its group trains alike in both: as it is
            out[obj_id] = opt[obj_id]
            continue
        raw = torch.zeros(layout.size_bytes, dtype=torch.uint8)
        layer = new.layout.packed[obj_id].layer
        for name, view in layout.views(raw).items():
            kept = entries.get(f"{layer}.{name}")
            if kept is not None and kept.shape == view.shape and kept.dtype == view.dtype:
                view.copy_(kept)
        out[obj_id] = raw
    return out
