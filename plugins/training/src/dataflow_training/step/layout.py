"""The typed step layout: what every task and packed object of a lowered step is.

The lowering returns it beside the Program (as one value, ``Lowered``), and it is passed
down with it. It is also written into ``program.metadata["training"]``, so that a program
written to a file keeps it, and read back from there in one place only:
``Lowered.read(program)``, the reader of a step written out. Executables, verify, the
profiling pass and the driver find objects by *role*, never by position or id:

========== ================================================================
role       objects
========== ================================================================
tokens     the round's input tokens ``x_s_r`` (embed forward and backward)
targets    the round's targets ``t_s_r`` (head)
segments   the round's segments ``S_s_r`` (``TrainConfig.segments`` only): int64 (2,
           batch, seq_len), a ``kit.Segments``' ids then positions; read by every task
           whose math reads ``Env.segments`` (a block's fwd, full rec and bwd)
x          a layer's input hidden state ``y_s_r_i``
y          a layer's output hidden state
w          parameter objects the task reads or updates (every group of a layer)
tied       parameter objects of another layer a tied head reads
saved      ``A_s_r_i`` (forward writes, recompute writes, backward reads); with a partial
           save, also ``A_s_r_i.<partial>`` (its rec task reads ``A_s_r_i`` and writes it)
aux_temp   ``AuxTemp_s_r_i`` (forward writes, recompute and backward read)
aux        ``Aux_i`` (forward mutates, the last round's backward reads)
dy         the gradient of a layer's output; ``dx`` the gradient of its input
grad       ``dW`` objects a task creates (round 0) or accumulates into
tied_grad  ``dW`` objects of the layer a tied head's gradient flows into
opt_state  ``O`` objects an optimizer task updates
loss       the round's loss
grad_norm  ``gn_`` objects: a parameter group's squared gradient norm (float32), written
           by its ``gnorm`` task, read by every optimizer task when clipping
d_experts  ``dE_s_r_i`` of a block routed apart: the gradient of its experts' input and
           of its routing weights, made by the expert shards' ``ebwd`` tasks and read by
           the block's ``bwd``
shared     objects of another layer a block's task reads or writes (``LayerSpec.leader``):
           a shared-index layer's fwd, rec and bwd read its leader's ``AuxTemp_s_r_l``;
           the group's KL target ``Target_s_r_l`` is made by the last member's
           bwd, changed by the middle members' and read by the leader's
========== ================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import cattrs

from dataflow import Program
from dataflow_training.step.config import TrainConfig, omit_empty_freeze
from dataflow_training.step.keys import ComputeKey, parse
from dataflow_training.step.packing import Layout

ROLES = (
    "tokens",
    "targets",
    "segments",
    "x",
    "y",
    "w",
    "tied",
    "saved",
    "aux_temp",
    "aux",
    "dy",
    "dx",
    "grad",
    "tied_grad",
    "opt_state",
    "loss",
    "grad_norm",
    "d_experts",
    "shared",
)

Roles = Mapping[str, tuple[str, ...]]

#: task kinds in chain order within a round, then the step's optimizer tasks
TASK_KINDS = (
    "embed",
    "fwd",
    "efwd",
    "head",
    "rec",
    "ebwd",
    "bwd",
    "embbwd",
    "allreduce",
    "gnorm",
    "opt",
)
#: what a packed object holds (``Target``: a group of shared-index layers' KL target)
PACKED_KINDS = ("W", "dW", "O", "A", "AuxTemp", "Aux", "dE", "Target")


def _roles(value: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    unknown = set(value) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown task role(s) {sorted(unknown)}; known: {', '.join(ROLES)}")
    return {role: tuple(ids) for role, ids in value.items() if ids}


@attrs.frozen
class TaskSlot:
    """One task of the step. ``group`` is the parameter group an optimizer task updates
    (``""`` for the main one); ``save`` is whether a forward task writes ``A``."""

    id: str
    kind: str
    layer: str
    round_: int
    compute_key: str
    inputs: dict[str, tuple[str, ...]] = attrs.field(converter=_roles, hash=False)
    mutates: dict[str, tuple[str, ...]] = attrs.field(factory=dict, converter=_roles, hash=False)
    outputs: dict[str, tuple[str, ...]] = attrs.field(factory=dict, converter=_roles, hash=False)
    group: str = ""
    save: bool = True

    @property
    def key(self) -> ComputeKey:
        return parse(self.compute_key)

    def objects(self, role: str) -> tuple[str, ...]:
        """Every object of ``role`` the task names, whether read, changed or made."""
        return self.inputs.get(role, ()) + self.mutates.get(role, ()) + self.outputs.get(role, ())

    def one(self, role: str) -> str:
        found = self.objects(role)
        if len(found) != 1:
            raise KeyError(f"task {self.id} has {len(found)} objects of role {role!r}")
        return found[0]


@attrs.frozen
class PackedObject:
    """A packed object: named tensors at the offsets of ``layout``. ``decay`` names the
    entries weight decay applies to (``W`` objects)."""

    id: str
    kind: str
    layer: str
    layout: Layout
    group: str = ""
    decay: tuple[str, ...] = ()


@attrs.frozen
class LayerInfo:
    name: str
    kind: str
    groups: tuple[str, ...]
    tied: dict[str, str] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class StepLayout:
    """Everything about a lowered step that is not in the Program's chain itself."""

    family: str
    preset: str
    overrides: dict[str, Any] = attrs.field(hash=False)
    train: TrainConfig
    step: int
    layers: tuple[LayerInfo, ...]
    tasks: dict[str, TaskSlot] = attrs.field(hash=False)
    packed: dict[str, PackedObject] = attrs.field(hash=False)

    METADATA_KEY = "training"

    @classmethod
    def of(cls, program: Program) -> StepLayout:
        """The layout a lowered program carries; a clear error for any other program."""
        data = program.metadata.get(cls.METADATA_KEY)
        if data is None:
            raise ValueError(
                f"program {program.name!r} has no training step layout: it was not lowered "
                "by dataflow-training (dataflow_training.step.lowering.lower)"
            )
        return _CONVERTER.structure(data, cls)

    def to_metadata(self) -> dict[str, Any]:
        return {self.METADATA_KEY: _CONVERTER.unstructure(self)}

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r}; layers: {', '.join(x.name for x in self.layers)}")

    def of_kind(self, kind: str) -> list[PackedObject]:
        return [p for p in self.packed.values() if p.kind == kind]

    def data_objects(self) -> dict[str, tuple[int, str]]:
        """Each round's token and target objects, and its segments where the step has
        them: ``{id: (round, "tokens" | "targets" | "segments")}`` (the embed task reads
        the tokens, the head task the targets, block tasks the segments)."""
        found = {}
        for slot in self.tasks.values():
            for role in ("tokens", "targets"):
                if slot.kind in ("embed", "head"):
                    for obj_id in slot.inputs.get(role, ()):
                        found[obj_id] = (slot.round_, role)
            for obj_id in slot.inputs.get("segments", ()):
                found[obj_id] = (slot.round_, "segments")
        return found

    def losses(self) -> tuple[str, ...]:
        """The step's loss objects, one a round, in round order."""
        heads = sorted((s for s in self.tasks.values() if s.kind == "head"), key=_round)
        return tuple(slot.one("loss") for slot in heads)

    def grad_norms(self) -> tuple[str, ...]:
        """The squared gradient norms the step's ``gnorm`` tasks write (none when the
        step neither clips nor measures its gradient norm)."""
        return tuple(slot.one("grad_norm") for slot in self.tasks.values() if slot.kind == "gnorm")

    def saved_by(self) -> dict[str, TaskSlot]:
        """Each saved-context object (``A`` and a partial save's rest) with the forward
        or ``rec`` task that writes it (its round and layer)."""
        return {
            obj_id: slot
            for slot in self.tasks.values()
            if slot.kind in ("fwd", "rec")
            for obj_id in slot.outputs.get("saved", ())
        }

    def task_of(self, kind: str, layer: str, round_: int) -> TaskSlot:
        """The task of ``kind`` for ``layer`` in round ``round_``."""
        for slot in self.tasks.values():
            if slot.kind == kind and slot.layer == layer and slot.round_ == round_:
                return slot
        raise KeyError(f"no {kind} task of layer {layer!r} in round {round_}")

    def views(self, obj_id: str, buffer: Any) -> dict[str, Any]:
        """Typed views of a packed object's named tensors in its flat ``buffer``."""
        return self.packed[obj_id].layout.views(buffer)


def _round(slot: TaskSlot) -> int:
    return slot.round_


_CONVERTER = cattrs.Converter()
omit_empty_freeze(_CONVERTER)
