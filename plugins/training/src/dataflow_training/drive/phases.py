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

A phase may also set config fields for its steps: ``START:PATTERNS:FIELD=VALUE,...``
(values typed as ``--value``'s: a bool, an int, a float, else text), on top of the
run's own config; a phase that sets none runs the run's config. A field that changes a
parameter's shape is refused: the weights carry over as they are. ``--phase 0:...``
gives the first phase itself (then ``--freeze`` is not given). A family may name
**recipes**, a phase's patterns and fields under one name (``Family.phase_recipes``,
e.g. DeepSeek V3.2's ``indexer-warmup``: dense attention, every parameter but the
indexers frozen, the selection bias still), written ``START:@NAME``: ``--phase
0:@indexer-warmup --phase 1000:`` warms the indexers up for 1,000 steps, then trains
everything sparse, in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from dataflow.cli import parse_value
from dataflow_training.drive.run import TrainingRun
from dataflow_training.drive.values import state_layouts
from dataflow_training.step.freezing import FreezeError, freeze_layers
from dataflow_training.step.lowering import Lowered


def _fields(value: Any) -> tuple[tuple[str, Any], ...]:
    """A phase's config fields as sorted (name, value) pairs (from a mapping or pairs)."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


@attrs.frozen
class PhaseRecipe:
    """A family's named phase (``Family.phase_recipes``): what it freezes and the config
    fields it sets, and a line that says what it is for."""

    freeze: tuple[str, ...] = attrs.field(converter=tuple)
    config: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_fields)
    doc: str = ""


@attrs.frozen
class Phase:
    """From ``start`` steps done on, the parameters ``freeze`` names do not train and the
    model's config has the fields ``config`` sets (on top of the run's). ``recipe``: the
    family recipe it was written as (``START:@NAME``), which ``resolve_phases`` expands."""

    start: int
    freeze: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    config: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_fields)
    recipe: str | None = None

    @classmethod
    def parse(cls, text: str) -> Phase:
        """``START:PATTERNS[:FIELD=VALUE,...]`` or ``START:@RECIPE`` (patterns
        comma-separated, none: everything trains); a ValueError names the text otherwise."""
        start, colon, rest = str(text).partition(":")
        if not colon or not start.strip().isdigit():
            raise ValueError(
                f"--phase {text}: give START:PATTERNS[:FIELD=VALUE,...], START the steps done "
                "before it and PATTERNS what it freezes, comma-separated (none: everything "
                "trains), e.g. 100: or 100:embed,layers.0-3 or 0:@indexer-warmup"
            )
        patterns, _, fields = rest.partition(":")
        if patterns.strip().startswith("@"):
            if fields:
                raise ValueError(f"--phase {text}: a recipe (@NAME) takes no FIELD=VALUE")
            return cls(int(start), recipe=patterns.strip()[1:])
        config = []
        for item in (f.strip() for f in fields.split(",") if f.strip()):
            name, eq, value = item.partition("=")
            if not eq or not name.strip():
                raise ValueError(f"--phase {text}: {item!r} is not FIELD=VALUE")
            config.append((name.strip(), parse_value(value.strip())))
        freeze = tuple(p.strip() for p in patterns.split(",") if p.strip())
        return cls(int(start), freeze, config)

    @classmethod
    def of(cls, value: Phase | str | Mapping[str, Any]) -> Phase:
        """A phase as given: itself, the command line's text, or the mapping a
        checkpoint's options record."""
        if isinstance(value, Phase):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        return cls(
            int(value["start"]),
            tuple(value["freeze"]),
            tuple(tuple(pair) for pair in value.get("config", ())),
            value.get("recipe"),
        )

    def describe(self) -> str:
        frozen = ", ".join(self.freeze) or "nothing"
        named = f"{self.recipe}: " if self.recipe else ""
        fields = "".join(f", {name} = {value!r}" for name, value in self.config)
        return f"from step {self.start + 1}: {named}frozen {frozen}{fields}"

    def overrides(self, run: Mapping[str, Any]) -> dict[str, Any]:
        """The config overrides of this phase's steps: the run's, then its own fields."""
        return {**run, **dict(self.config)}


def phases_of(values: Iterable[Phase | str | Mapping[str, Any]]) -> tuple[Phase, ...]:
    """``TrainOptions.phases`` as given, in order of their starts; two at one step is a
    ValueError naming it."""
    phases = sorted((Phase.of(v) for v in values), key=lambda p: p.start)
    for before, after in zip(phases, phases[1:], strict=False):
        if before.start == after.start:
            raise ValueError(f"--phase: two phases start at step {after.start}")
    return tuple(phases)


def run_phases(
    freeze: tuple[str, ...], phases: Iterable[Phase], family: Any = None
) -> tuple[Phase, ...]:
    """Every phase of a run: ``freeze`` from step 0 (or the ``--phase 0:...`` given
    instead), then ``phases``, each recipe expanded from ``family``'s (``resolve_phases``)."""
    phases = tuple(phases)
    if phases and phases[0].start == 0:
        if freeze:
            raise ValueError(
                "--phase 0:... and --freeze both say what the first steps freeze: give one"
            )
        every = phases
    else:
        every = (Phase(0, freeze), *phases)
    return resolve_phases(every, family)


def resolve_phases(phases: tuple[Phase, ...], family: Any) -> tuple[Phase, ...]:
    """``phases`` with each ``START:@NAME`` filled from ``family.phase_recipes`` (its
    patterns and fields; the name kept for the lines and the checkpoint); an unknown name
    is a ValueError naming the family's."""
    recipes: Mapping[str, PhaseRecipe] = getattr(family, "phase_recipes", None) or {}
    out = []
    for phase in phases:
        if phase.recipe is not None:
            recipe = recipes.get(phase.recipe)
            if recipe is None:
                name = getattr(family, "name", "this family")
                known = ", ".join(f"@{r}" for r in recipes) or "none"
                raise ValueError(
                    f"--phase {phase.start}:@{phase.recipe}: {name} has no phase recipe "
                    f"{phase.recipe!r} (its recipes: {known})"
                )
            phase = attrs.evolve(phase, freeze=recipe.freeze, config=recipe.config)
        out.append(phase)
    return tuple(out)


def _written(phase: Phase) -> str:
    """The phase as the command line writes it, for errors."""
    if phase.recipe is not None:
        return f"--phase {phase.start}:@{phase.recipe}"
    fields = ",".join(f"{k}={v}" for k, v in phase.config)
    return f"--phase {phase.start}:{','.join(phase.freeze)}" + (f":{fields}" if fields else "")


def check_phases(
    phases: tuple[Phase, ...],
    family: Any,
    preset: str,
    overrides: Mapping[str, Any],
) -> None:
    """Every phase checked before the run starts, so a typo in a late phase is said at
    once: its config fields make a config of ``family`` (a ValueError naming the field),
    whose parameters are the first phase's, name for name and shape for shape (the
    weights carry over), and its patterns name parameters of it (``FreezeError``)."""
    shapes = None
    for phase in phases:
        written = _written(phase)
        try:
            config = family.config(preset, **phase.overrides(overrides))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{written}: {exc}") from None
        layers = family.layers(config)
        params = {(layer.name, p.name): tuple(p.shape) for layer in layers for p in layer.params}
        if shapes is None:
            shapes = params
        elif params != shapes:
            raise ValueError(
                f"{written}: its config fields {[k for k, _ in phase.config]} change the "
                "model's parameters; a phase keeps every parameter's shape"
            )
        try:
            freeze_layers(layers, phase.freeze)
        except FreezeError as exc:
            if phase.start == 0 and phase.recipe is None and not phase.config:  # --freeze
                raise
            raise FreezeError(f"{written}: {exc}") from None


def phase_at(phases: tuple[Phase, ...], done: int) -> int:
    """The index of the phase of the step after ``done`` steps."""
    return max(i for i, phase in enumerate(phases) if phase.start <= done)


class PhasedRun:
    """A run over its phases: the ``TrainingRun`` of the phase under way (``current``),
    replaced by the next phase's at its first step. ``compile(freeze)`` compiles the
    step of a phase (the run's shape, budget and device, with its freeze and config); ``say``
    gets a line at each boundary."""

    def __init__(
        self,
        current: TrainingRun,
        phases: tuple[Phase, ...],
        compile: Callable[[Phase], Any],
        say: Callable[[str], None],
        plan_line: Callable[[Any], str],
        index: int | None = None,
    ) -> None:
        self.current, self.phases, self.compile, self.say = current, phases, compile, say
        self.plan_line = plan_line
        #: the phase ``current`` runs: its updates' unless given (a checkpoint saved at a
        #: boundary is of the phase before it, which the next step leaves)
        self.index = phase_at(phases, current.updates) if index is None else index

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

    def host_weights(self) -> Mapping[str, torch.Tensor]:
        """``TrainingRun.host_weights`` of the phase under way (an evaluation's)."""
        return self.current.host_weights()

    def _enter(self, index: int) -> None:
        old = self.current
        old.close()  # its device memory given back, its state kept on the host: a compile
        # that fails leaves the run as it was
        weights, opt = old.state()
        compiled = self.compile(self.phases[index])
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
