"""The executables of a lowered training step, for every family.

``TrainingTasks(program)`` is a ``Resolver``: it dispatches on the task's compute key
(``dataflow_training.step.keys``), finds the task's objects by role in the step layout
(``dataflow_training.step.layout``), views packed objects as the family's named tensors, calls
the family's math with ops from the kernel registry, checks what the math returned
against what the family declared, and writes only into the task's outputs and mutates.

Resolver packages (``resolvers/``) are execution *strategies* over these executables: a
``Strategy`` may wrap each block kind's math (``torch.compile``, say) or launch the whole
step differently; a new family never touches a resolver.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dataflow import LaunchContext, Program, Task
from dataflow_training.kit.lora import task_seed, with_lora, with_seed
from dataflow_training.kit.lora_base import OPS as BASE_OPS
from dataflow_training.kit.segments import Segments
from dataflow_training.step.family import (
    Env,
    FamilyContractError,
    RowGradient,
    RowPieces,
    head_layer,
    stored_pieces,
)
from dataflow_training.step.keys import ComputeKeyError, parse
from dataflow_training.step.layout import TaskSlot
from dataflow_training.step.lowering import Lowered, layer_role
from dataflow_training.step.ops import load_ops
from dataflow_training.step.optimizers import hyperparameters, optimizer_spec
from dataflow_training.step.packing import flat_view

Tensors = dict[str, torch.Tensor]


#: Where one value a block's math returns goes: the path to it in what the function
#: returned (tuple indexes, dict keys), the view it is written into, whether it is added
#: to what the view holds (a later round's gradients) and what it is, for errors.
Put = tuple[tuple[int | str, ...], torch.Tensor, bool, str]


def put_all(result: Any, puts: list[Put]) -> None:
    """Write every value ``puts`` names from ``result`` into its view (copied, or added).
    A value missing or of another shape than its view is a ``FamilyContractError`` (the
    caller names the task)."""
    for path, target, add, what in puts:
        value = result
        for step in path:
            value = value.get(step) if isinstance(value, Mapping) else value[step]
            if value is None:
                raise FamilyContractError(f"returned no {what}")
        _check_shape(None, what, value, target.shape)
        if add:
            target.add_(value)
        else:
            target.copy_(value)


class Strategy:
    """How the executables run a family's math; the eager strategy changes nothing."""

    name = "eager"

    def block_math(self, kind: str, math: Any) -> Any:
        """The math object executables call for block kind ``kind``."""
        return math

    def run_into(self, math: Any, function: str, puts: list[Put], *args: Any) -> None:
        """Call ``math.<function>(*args)`` and write what it returns into ``puts``. A
        compiling strategy compiles the writes with the math, so a value computed by a
        fused kernel is stored by that kernel instead of being copied afterwards."""
        put_all(getattr(math, function)(*args), puts)


class TrainingTasks:
    """``Resolver`` for programs lowered by dataflow-training."""

    def __init__(
        self,
        step: Lowered | Program,
        *,
        ops: Mapping[str, Any] | None = None,
        strategy: Strategy | None = None,
    ) -> None:
        """``step``: the lowered step whose tasks these run (a program read from a file
        is read as its step, ``Lowered.read``); ``ops`` default to the kernel registry's
        (tests pass their own)."""
        if not isinstance(step, Lowered):
            step = Lowered.read(step)
        self.layout = step.layout
        family = step.family
        self.family = family
        self.strategy = strategy or Strategy()
        self.config = step.config
        self.train = self.layout.train
        self.optimizer = optimizer_spec(self.train.optimizer.name)
        #: each layer's role (``lowering.layer_role``), what the optimizer's update gets
        self.roles = {layer.name: layer_role(layer, step.layers) for layer in step.layers}
        #: each stored piece's ``(index, count)`` by ``(layer, group, param)``: the
        #: vocabulary tables' row pieces (``step.pieces``) and the expert shards'
        self.pieces = {key: p.piece for key, p in stored_pieces(step.layers).items()}
        #: each layer's parameters updated by a rule (``TensorSpec.rule``), by group
        self.ruled = {
            (layer.name, group.name): tuple(p.name for p in group.params if p.rule is not None)
            for layer in step.layers
            for group in layer.groups
        }
        #: the head's output projection: its largest parameter (a row per vocabulary
        #: entry), what ``head_accumulate="gradient"`` adds into (``HeadLoss``)
        head = head_layer(step.layers)
        self.projection = max(head.params, key=lambda p: math.prod(p.shape)).name
        self._given_ops = ops
        self._ops: dict[str, dict[str, Any]] = {}
        self._math: dict[str, Any] = {}

    def ops(self, device: str) -> Mapping[str, Any]:
        if self._given_ops is not None:
            return with_lora(self._given_ops, self.train.lora)
        if device not in self._ops:
            lora = self.train.lora
            base_ops = BASE_OPS.get(lora.base, ()) if lora is not None else ()
            names = (*self.family.ops, *self.optimizer.ops, *base_ops)
            self._ops[device] = dict(with_lora(load_ops(device, names), self.train.lora))
        return self._ops[device]

    def math(self, kind: str) -> Any:
        if kind not in self._math:
            math = self.family.math(kind)
            self._math[kind] = (
                math if kind in ("embed", "head") else self.strategy.block_math(kind, math)
            )
        return self._math[kind]

    def __call__(self, task: Task) -> Any:
        try:
            key = parse(task.compute_key)
        except ComputeKeyError as exc:
            raise KeyError(str(exc)) from None
        slot = self.layout.tasks.get(task.id)
        if slot is None or slot.compute_key != task.compute_key:
            raise KeyError(f"task {task.id} ({task.compute_key}) is not in the step layout")
        if key.is_optimizer:
            return OptimizerStep(self, task, slot)
        if key.is_grad_norm:
            return GradNorm(self, task, slot)
        if key.is_grad_allreduce:
            return GradAllReduce(self, task, slot)
        if key.family != self.family.name:
            raise KeyError(
                f"compute key {task.compute_key!r} is not of family {self.family.name!r}"
            )
        cls = {
            ("embed", "forward"): EmbedForward,
            ("embed", "backward"): EmbedBackward,
            ("head", "loss"): HeadLoss,
        }.get((key.kind, key.phase))
        if cls is None:
            cls = {
                "forward": BlockForward,
                "recompute": BlockRecompute,
                "backward": BlockBackward,
                "route_forward": RouteForward,
                "route_recompute": RouteRecompute,
                "experts_forward": ExpertsForward,
                "experts_backward": ExpertsBackward,
                "route_backward": RouteBackward,
            }[key.phase]
        return cls(self, task, slot)


class _Exec:
    #: Every training executable only enqueues device work and reads per-step values as
    #: they come (device tensors when the engine replays a CUDA graph): capturable.
    capturable = True

    def __init__(self, tasks: TrainingTasks, task: Task, slot: TaskSlot) -> None:
        self.tasks, self.task, self.slot = tasks, task, slot
        self.layout = tasks.layout
        self.kind = self.layout.layer(slot.layer).kind
        self.layer_index = [layer.name for layer in self.layout.layers].index(slot.layer)
        self._index = {
            obj: (part, i)
            for part in ("inputs", "mutates", "outputs")
            for i, obj in enumerate(getattr(task, part))
        }
        self._views: dict[str, tuple[tuple[int, int], Tensors]] = {}

    def buffer(self, ctx: LaunchContext, obj_id: str) -> torch.Tensor:
        part, i = self._index[obj_id]
        return getattr(ctx, part)[i]

    def env(self, ctx: LaunchContext, **fields: Any) -> Env:
        train = self.tasks.train
        ops = self.tasks.ops(ctx.device)
        update = ctx.values.get("update")
        if update is not None and self.slot.kind in ("fwd", "rec", "bwd"):
            # LoRA's dropout masks (kit.lora): one seed per update, round and layer, only
            # in a training step (an evaluation passes no update)
            ops = with_seed(ops, task_seed(update, self.slot.round_, self.layer_index))
        segments = self.slot.inputs.get("segments")
        if segments:  # the round's S object: ids, then positions (TrainConfig.segments)
            fields["segments"] = Segments.of_stacked(self.buffer(ctx, segments[0]))
        return Env(
            ops,
            round_=self.slot.round_,
            rounds=train.rounds,
            chunk_tokens=train.chunk_tokens,
            head_vocab_tiles=train.head_vocab_tiles,
            **fields,
        )

    def views(self, ctx: LaunchContext, obj: str) -> Tensors:
        """A packed object's named views. On CUDA an object sits at the same arena offset
        every step, so the views of its last address are kept and reused (building a
        dozen views is host time every launch); elsewhere they are built each time."""
        buffer = self.buffer(ctx, obj)
        if ctx.device != "cuda":
            return self.layout.views(obj, buffer)
        key = (buffer.data_ptr(), buffer.numel())
        cached = self._views.get(obj)
        if cached is None or cached[0] != key:
            cached = (key, self.layout.views(obj, buffer))
            self._views[obj] = cached
        return dict(cached[1])

    def named(self, ctx: LaunchContext, role: str) -> Tensors:
        """Every packed object of ``role`` viewed as named tensors, merged; a tensor whose
        every row piece the role holds (a vocabulary table, ``step.pieces``) as one
        ``RowPieces`` of them in row order (a piece alone, an expert shard's, as it is)."""
        out: Tensors = {}
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        counts: dict[str, int] = {}
        for obj in self.slot.objects(role):
            for name, view in self.views(ctx, obj).items():
                piece = self.piece(obj, name)
                if piece is not None:
                    pieces.setdefault(name, {})[piece[0]] = view
                    counts[name] = piece[1]
                    continue
                out[name] = view
        for name, found in pieces.items():
            count = counts[name]
            if len(found) == count:
                out[name] = RowPieces(found[j] for j in range(count))
            elif len(found) == 1:
                out[name] = next(iter(found.values()))
            else:
                raise FamilyContractError(
                    f"task {self.task.id}: holds {len(found)} of the {count} pieces of {name!r}"
                )
        return out

    def piece(self, obj: str, name: str) -> tuple[int, int] | None:
        """``(index, count)`` where ``obj`` stores a row piece of ``name``, else None."""
        packed = self.layout.packed[obj]
        return self.tasks.pieces.get((packed.layer, packed.group, name))

    def one(self, ctx: LaunchContext, role: str) -> torch.Tensor:
        return self.buffer(ctx, self.slot.one(role))

    def shared(self, ctx: LaunchContext) -> Tensors:
        """``env.shared``: the objects of other layers the task reads or writes (role
        ``shared``), an object it creates zeroed first (the math adds into it)."""
        for obj in self.slot.outputs.get("shared", ()):
            self.buffer(ctx, obj).zero_()
        return self.named(ctx, "shared")

    def store_grads(
        self,
        ctx: LaunchContext,
        role: str,
        grads: Mapping[str, Any],
        *,
        partial: bool = False,
        written: frozenset[str] = frozenset(),
    ) -> None:
        """Write (round 0) or accumulate the gradients into the ``role`` objects; each
        trainable tensor must have its gradient, of its shape. With ``partial`` (a tied
        head's share of another layer's gradients) tensors without one are left alone,
        or zeroed where the task creates the object (an output is fully written).
        ``written``: tensors the math added into their views itself (``grad_targets``)."""
        for obj in self.slot.objects(role):
            add = obj in self.slot.mutates.get(role, ())
            if not add:
                self.zero_gaps(ctx, obj)
            for name, target in self.views(ctx, obj).items():
                if name in written:
                    continue
                value = grads.get(name)
                if value is None and partial:
                    if not add:
                        target.zero_()
                    continue
                if value is None:
                    raise FamilyContractError(
                        f"task {self.task.id}: {self.task.compute_key} returned no gradient "
                        f"for {obj}:{name}"
                    )
                first, piece = 0, self.piece(obj, name)
                what = f"gradient {name}"
                if piece is None:
                    _check_shape(self.task, what, value, target.shape)
                else:  # a row piece of a table: its share of the gradient, checked
                    value, first = self._piece_of(value, piece, target, what)
                if isinstance(value, RowGradient):
                    (value.add_into if add else value.copy_into)(target, first)
                elif add:
                    target.add_(value)
                else:
                    target.copy_(value)

    def _piece_of(
        self, value: Any, piece: tuple[int, int], target: torch.Tensor, what: str
    ) -> tuple[Any, int]:
        """(piece ``index`` of ``count`` of the gradient ``value``, the first row of the
        whole table that ``target`` holds), its shape checked: a tuple with one gradient
        per piece gives its own; a ``RowGradient`` of the whole table stays whole (it
        writes the piece's rows, from that first row); a whole table gives its rows; the
        piece's own tensor is taken as it is."""
        index, count = piece
        rows = target.shape[0]
        whole = (rows * count, *target.shape[1:])
        if isinstance(value, tuple | list):
            if len(value) != count:
                raise FamilyContractError(
                    f"task {self.task.id}: {self.task.compute_key} gave {len(value)} "
                    f"pieces of its {what}, which is stored in {count}"
                )
            value = value[index]
        elif isinstance(value, RowGradient):
            _check_shape(self.task, what, value, whole)
            return value, index * rows
        elif tuple(value.shape) == whole:
            value = value[index * rows : (index + 1) * rows]
        _check_shape(self.task, what, value, target.shape)
        return value, 0

    def puts(
        self,
        ctx: LaunchContext,
        role: str,
        path: tuple[int | str, ...],
        what: str,
        *,
        obj: str | None = None,
        grads: bool = False,
    ) -> list[Put]:
        """Where a block's returned dict at ``path`` goes: one ``Put`` per declared tensor
        of every ``role`` object (or of ``obj``), gradients (``grads``) added in a round
        that accumulates and copied, padding zeroed, in the one that creates them."""
        objs = [obj] if obj is not None else self.slot.objects(role)
        out: list[Put] = []
        for each in objs:
            add = grads and each in self.slot.mutates.get(role, ())
            if grads and not add:
                self.zero_gaps(ctx, each)
            for name, target in self.views(ctx, each).items():
                label = f"gradient for {each}:{name}" if grads else f"{what} {name!r}"
                out.append(((*path, name), target, add, label))
        return out

    def run_into(self, function: str, puts: list[Put], *args: Any) -> None:
        """The block's ``function`` with its values written into ``puts`` by the
        strategy; a broken contract names the task."""
        try:
            self.tasks.strategy.run_into(self.tasks.math(self.kind), function, puts, *args)
        except FamilyContractError as exc:
            raise FamilyContractError(
                f"task {self.task.id}: {self.task.compute_key} {exc}"
            ) from None

    def run_rows(
        self, function: str, rows: list[Put], whole: list[Put], cut: tuple[int, ...], *args: Any
    ) -> None:
        """``run_into`` over the task's ``row_groups`` (``TrainConfig.block_row_groups``;
        1: the batch at once) groups of the round's sequences, one after the other: the
        ``rows`` puts' targets and the args at positions ``cut`` (tensors, or dicts of
        them) cut to the group's rows (every one batch-major, as the lowering checked),
        the ``whole`` puts (gradients) written by the first group as given and added by
        the others."""
        groups = self.task.params.get("row_groups", 1)
        if groups == 1:
            self.run_into(function, [*rows, *whole], *args)
            return
        for group in range(groups):

            def part(t: torch.Tensor, group: int = group) -> torch.Tensor:
                size = t.shape[0] // groups  # the batch times one sequence's rows
                return t[group * size : (group + 1) * size]

            given = [
                ({k: part(v) for k, v in a.items()} if isinstance(a, dict) else part(a))
                if i in cut
                else a
                for i, a in enumerate(args)
            ]
            puts = [(path, part(target), add, what) for path, target, add, what in rows]
            puts += [(path, target, add or group > 0, what) for path, target, add, what in whole]
            self.run_into(function, puts, *given)

    def zero_gaps(self, ctx: LaunchContext, obj: str) -> None:
        """Zeros in a created object's padding, so flat spans over it are clean."""
        buffer = self.buffer(ctx, obj)
        for start, end in self.layout.packed[obj].layout.gaps():
            buffer[start:end].zero_()


def _check_shape(task: Task | None, what: str, value: Any, shape: Any) -> None:
    """``value`` has the declared ``shape``, or a ``FamilyContractError`` naming ``what``
    (and the task, where given; ``put_all``'s caller adds it)."""
    if tuple(value.shape) != tuple(shape):
        prefix = f"task {task.id}: {task.compute_key} " if task is not None else ""
        raise FamilyContractError(
            f"{prefix}gave {what} of shape {tuple(value.shape)}; declared {tuple(shape)}"
        )


class EmbedForward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        y = self.tasks.math("embed").forward(
            self.tasks.config, self.named(ctx, "w"), self.one(ctx, "tokens"), self.env(ctx)
        )
        _check_shape(self.task, "output", y, self.one(ctx, "y").shape)
        self.one(ctx, "y").copy_(y)


class EmbedBackward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        grads = self.tasks.math("embed").backward(
            self.tasks.config, self.one(ctx, "tokens"), self.one(ctx, "dy"), self.env(ctx)
        )
        self.store_grads(ctx, "grad", grads)


class BlockForward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        aux = self.named(ctx, "aux")
        if self.task.params.get("zero_aux"):
            for tensor in aux.values():
                tensor.zero_()  # Aux over the step: zeroed by the first forward touching it
        puts: list[Put] = [((0,), self.one(ctx, "y"), False, "output")]
        if self.slot.save:
            puts += self.puts(ctx, "saved", (1,), "saved tensor", obj=self.slot.one("saved"))
        if self.slot.objects("aux_temp"):
            puts += self.puts(
                ctx, "aux_temp", (2,), "aux_temp tensor", obj=self.slot.one("aux_temp")
            )
        self.run_rows(
            "forward",
            puts,
            [],
            (2,),
            self.tasks.config,
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.env(ctx, aux=aux, shared=self.shared(ctx)),
        )


class BlockRecompute(_Exec):
    """The full recompute (``A`` from the block input), or with the task's ``partial``
    param the rest of a partial save (``A_...<name>`` from ``A``, which forward kept)."""

    def launch(self, ctx: LaunchContext) -> None:
        partial = self.task.params.get("partial")
        if partial is not None:
            (kept,), (rest,) = self.slot.inputs["saved"], self.slot.outputs["saved"]
            self.run_rows(
                "rederive",
                self.puts(ctx, "saved", (), f"{partial!r} tensor", obj=rest),
                [],
                (2, 3),
                self.tasks.config,
                self.named(ctx, "w"),
                self.one(ctx, "x"),
                self.views(ctx, kept),
                self.named(ctx, "aux_temp"),
                self.env(ctx, shared=self.shared(ctx)),
                partial,
            )
            return
        self.run_rows(
            "recompute",
            self.puts(ctx, "saved", (), "saved tensor", obj=self.slot.one("saved")),
            [],
            (2,),
            self.tasks.config,
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.named(ctx, "aux_temp"),
            self.env(ctx, shared=self.shared(ctx)),
        )


class BlockBackward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        # the lowest block of a frozen bottom makes no dx: its math's is dropped
        puts: list[Put] = [
            ((0,), self.buffer(ctx, dx), False, "dx") for dx in self.slot.objects("dx")
        ]
        self.run_rows(
            "backward",
            puts,
            self.puts(ctx, "grad", (1,), "gradient", grads=True),
            (2, 3, 5),
            self.tasks.config,
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.named(ctx, "saved"),
            self.named(ctx, "aux_temp"),
            self.one(ctx, "dy"),
            self.env(ctx, aux=self.named(ctx, "aux"), shared=self.shared(ctx)),
        )


class _Apart(_Exec):
    """A task of a block whose experts run apart (``kit.block.Block``'s ``route_*`` and
    ``experts_*``): the strategy's block math called (a compiling strategy compiles the
    routing tasks' functions), its results written here."""

    def call(self, function: str, *args: Any) -> Any:
        try:
            return getattr(self.tasks.math(self.kind), function)(self.tasks.config, *args)
        except FamilyContractError as exc:
            raise FamilyContractError(
                f"task {self.task.id}: {self.task.compute_key} {exc}"
            ) from None

    def shard(self) -> tuple[int, int]:
        return self.task.params["shard"], self.task.params["shards"]

    def put(self, what: str, value: Any, target: torch.Tensor, *, add: bool = False) -> None:
        self._check_given(what, value, target)
        (target.add_ if add else target.copy_)(value)

    def put_rows(
        self, ctx: LaunchContext, what: str, value: Any, target: torch.Tensor, window: Any
    ) -> None:
        """A shard's rows of ``value`` (in ``window``'s order: a ``kit.moe.ShardWindow``)
        into ``target`` (every row of the layer); the others keep theirs."""
        self._check_given(what, value, target)
        window.put(self.tasks.ops(ctx.device), value, target)

    def _check_given(self, what: str, value: Any, target: torch.Tensor) -> None:
        if value is None:
            raise FamilyContractError(
                f"task {self.task.id}: {self.task.compute_key} gave no {what}"
            )
        _check_shape(self.task, what, value, target.shape)


class RouteForward(_Apart):
    """The attention half, the router and the shared expert: the block's output without
    its routed experts, ``A``, AuxTemp and the experts' input."""

    def launch(self, ctx: LaunchContext) -> None:
        aux = self.named(ctx, "aux")
        if self.task.params.get("zero_aux"):
            for tensor in aux.values():
                tensor.zero_()
        y, saved, aux_temp, experts = self.call(
            "route_forward",
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.env(ctx, aux=aux, shared=self.shared(ctx)),
        )
        self.put("output", y, self.one(ctx, "y"))
        *main, experts_obj = self.slot.outputs["saved"]  # A (with a backward), the experts'
        for obj in main:
            for name, target in self.views(ctx, obj).items():
                self.put(f"saved tensor {name!r}", saved.get(name), target)
        self.put("experts' input", experts.get("moe_in"), self.views(ctx, experts_obj)["moe_in"])
        for name, target in self.views(ctx, self.slot.one("aux_temp")).items():
            self.put(f"aux_temp tensor {name!r}", aux_temp.get(name), target)


class RouteRecompute(_Apart):
    """What the routing task saves (``A``: the attention half's, the shared expert's) and
    the experts' input, made again before the block's shards' backward by forward's
    routing (AuxTemp)."""

    def launch(self, ctx: LaunchContext) -> None:
        saved, experts = self.call(
            "route_recompute",
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.named(ctx, "aux_temp"),
            self.env(ctx, shared=self.shared(ctx)),
        )
        main, experts_obj = self.slot.outputs["saved"]
        for name, target in self.views(ctx, main).items():
            self.put(f"saved tensor {name!r}", saved.get(name), target)
        self.put("experts' input", experts.get("moe_in"), self.views(ctx, experts_obj)["moe_in"])


class ExpertsForward(_Apart):
    """One shard's experts over the rows routed to them: their weighted outputs added
    into the block's output, their ``gate_up`` rows written where the experts' object
    has room for them (not where it is their input alone: re-derived, or no backward)."""

    def launch(self, ctx: LaunchContext) -> None:
        experts = self.views(ctx, self.slot.one("saved"))
        out, gate_up, window = self.call(
            "experts_forward",
            self.named(ctx, "w"),
            experts,
            self.named(ctx, "aux_temp"),
            self.shard(),
            self.env(ctx),
        )
        y = self.buffer(ctx, self.slot.one("y"))
        self.put("output", out.to(y.dtype).view_as(y), y, add=True)
        if "gate_up" in experts:
            self.put_rows(ctx, "gate_up rows", gate_up, experts["gate_up"], window)


class ExpertsBackward(_Apart):
    """One shard's experts' backward: their gradients, and their part of the block's
    ``dE`` (the gradient of the experts' input, added; their rows' routing weights')."""

    def launch(self, ctx: LaunchContext) -> None:
        (experts_obj,) = self.slot.inputs["saved"]
        d_moe_in, d_weights, window, grads = self.call(
            "experts_backward",
            self.named(ctx, "w"),
            self.views(ctx, experts_obj),
            self.named(ctx, "aux_temp"),
            self.one(ctx, "dy"),
            self.shard(),
            self.env(ctx),
        )
        d_obj = self.slot.one("d_experts")
        made = d_obj in self.slot.outputs.get("d_experts", ())
        d = self.views(ctx, d_obj)
        if made:
            self.buffer(ctx, d_obj).zero_()
        self.put("gradient of the experts' input", d_moe_in, d["d_moe_in"], add=True)
        self.put_rows(ctx, "routing weights' gradient", d_weights, d["d_weights"], window)
        if self.slot.objects("grad"):
            self.store_grads(ctx, "grad", grads)


class RouteBackward(_Apart):
    """The router's, the shared expert's and the attention half's backward, given the
    shards' ``dE``: the block's ``dx`` and its main group's gradient."""

    def launch(self, ctx: LaunchContext) -> None:
        dx, grads = self.call(
            "route_backward",
            self.named(ctx, "w"),
            self.one(ctx, "x"),
            self.named(ctx, "saved"),
            self.named(ctx, "aux_temp"),
            self.one(ctx, "dy"),
            self.named(ctx, "d_experts"),
            self.env(ctx, aux=self.named(ctx, "aux"), shared=self.shared(ctx)),
        )
        for obj in self.slot.objects("dx"):
            self.put("dx", dx, self.buffer(ctx, obj))
        if self.slot.objects("grad"):
            self.store_grads(ctx, "grad", grads)


class HeadLoss(_Exec):
    def __init__(self, tasks: TrainingTasks, task: Task, slot: TaskSlot) -> None:
        super().__init__(tasks, task, slot)
        self.tied = self.layout.layer(slot.layer).tied  # local name -> "layer.param"

    def launch(self, ctx: LaunchContext) -> None:
        params = self.named(ctx, "w")
        tied_views = self.named(ctx, "tied")
        for local, target in self.tied.items():
            params[local] = tied_views[target.partition(".")[2]]
        into, written = self.grad_targets(ctx)
        env = self.env(ctx, grad_scale=1.0 / self.tasks.train.rounds, head_grad_into=into)
        loss, dx, grads = self.tasks.math("head").forward_backward(
            self.tasks.config, params, self.one(ctx, "x"), self.one(ctx, "targets"), env
        )
        self.one(ctx, "loss").copy_(loss)
        if self.slot.objects("dx"):  # none where nothing below the head trains, nor in a
            # forward-only step (its head makes the loss alone)
            _check_shape(self.task, "dx", dx, self.one(ctx, "dx").shape)
            self.one(ctx, "dx").copy_(dx)
        self.store_grads(
            ctx, "grad", {k: v for k, v in grads.items() if k not in self.tied}, written=written
        )
        if self.slot.objects("tied_grad"):
            tied = {self.tied[k].partition(".")[2]: v for k, v in grads.items() if k in self.tied}
            self.store_grads(ctx, "tied_grad", tied, partial=True)

    def grad_targets(self, ctx: LaunchContext) -> tuple[tuple[torch.Tensor, ...] | None, frozenset]:
        """With ``TrainConfig.head_accumulate="gradient"``: the projection's gradient views
        (one a row piece, in row order; zeroed in the round that creates them) for the
        head to add into (``Env.head_grad_into``), and its name; else (None, none). The
        projection is the head's one parameter with a row per vocabulary entry."""
        name = self.tasks.projection
        if self.tasks.train.head_accumulate != "gradient" or name in self.tied:
            return None, frozenset()
        views: list[tuple[int, torch.Tensor]] = []
        for obj in self.slot.objects("grad"):
            view = self.views(ctx, obj).get(name)
            if view is None:
                continue
            if obj not in self.slot.mutates.get("grad", ()):  # this round creates it
                view.zero_()
            views.append(((self.piece(obj, name) or (0, 1))[0], view))
        if not views:  # a frozen head: no gradient of it
            return None, frozenset()
        return tuple(view for _, view in sorted(views, key=lambda item: item[0])), frozenset({name})


class OptimizerStep(_Exec):
    """One update of a parameter group, every tensor at once: one flat tensor for the
    entries with weight decay and one for those without, where the packed layouts line up
    element for element (``dataflow_training.step.packing``), else lists of the entries.

    From the run's values (``Engine.run(values=...)``): ``lr`` (default the policy's) and
    ``update``, the optimizer's own 1-based step count (default the engine's step + 1; a
    resumed run passes it so bias correction continues). With ``TrainConfig.clip`` the
    group's gradient is first scaled in place by the global clip factor."""

    def __init__(self, tasks: TrainingTasks, task: Task, slot: TaskSlot) -> None:
        super().__init__(tasks, task, slot)
        self.w_obj, self.o_obj, self.g_obj = slot.one("w"), slot.one("opt_state"), slot.one("grad")
        packed = self.layout.packed
        decay = set(packed[self.w_obj].decay)
        names = [e.name for e in packed[self.g_obj].layout.entries]
        fields = tasks.optimizer.state_fields
        self.layouts = {o: packed[o].layout for o in (self.w_obj, self.g_obj, self.o_obj)}
        spec = tasks.optimizer
        self.policy = hyperparameters(tasks.train.optimizer, spec)  # lr replaced per launch
        self.roles = tasks.roles[slot.layer]
        self.ruled = tasks.ruled.get((slot.layer, slot.group), ())
        # (names, weight decay on?, byte ranges of the flat spans or None for lists)
        self.classes: list[tuple[list[str], bool, dict[str, tuple] | None]] = []
        for decayed in (True, False):
            chosen = [n for n in names if (n in decay) == decayed]
            if chosen:
                spans = self._spans(chosen, fields) if spec.elementwise else None
                self.classes.append((chosen, decayed, spans))

    def _spans(self, names: list[str], fields: tuple[str, ...]) -> dict[str, tuple] | None:
        """The byte ranges of one flat span over ``names`` in W and dW (by object) and in
        each state field (by field), worked out once; None when they do not line up."""
        if not self._aligned(names, fields):
            return None
        spans = {o: self.layouts[o].span_range(names) for o in (self.w_obj, self.g_obj)}
        for f in fields:
            spans[f] = self.layouts[self.o_obj].span_range([f"{n}/{f}" for n in names])
        return None if None in spans.values() else spans

    def _aligned(self, names: list[str], fields: tuple[str, ...]) -> bool:
        """Whether the entries sit at the same element offsets in W, dW and each state."""
        packed = self.layout.packed

        def offsets(layout: Any, keys: list[str]) -> tuple[int, ...] | None:
            entries = [layout.entry(k) for k in keys]
            if len({e.dtype for e in entries}) != 1:
                return None
            itemsize = entries[0].size_bytes // max(1, math.prod(entries[0].shape))
            base = entries[0].offset_bytes
            ends = entries[-1].offset_bytes + entries[-1].size_bytes
            return (
                *((e.offset_bytes - base) // itemsize for e in entries),
                (ends - base) // itemsize,
            )

        found = {
            offsets(packed[self.w_obj].layout, names),
            offsets(packed[self.g_obj].layout, names),
            *(offsets(packed[self.o_obj].layout, [f"{n}/{f}" for n in names]) for f in fields),
        }
        return len(found) == 1 and None not in found

    def launch(self, ctx: LaunchContext) -> None:
        spec = self.tasks.optimizer
        buffers = {o: self.buffer(ctx, o) for o in (self.w_obj, self.g_obj, self.o_obj)}
        policy = dict(self.policy, lr=_number(ctx.values.get("lr", self.policy["lr"])))
        step = ctx.values.get("update")
        if step is None:
            step = ctx.values.get("step", 0) + 1
        step = _number(step, int)
        scale = self.clip_factor(ctx)
        for names, decayed, spans in self.classes:
            if spans is not None:
                w, g = ([flat_view(buffers[o], *spans[o])] for o in (self.w_obj, self.g_obj))
                states = {f: [flat_view(buffers[self.o_obj], *spans[f])] for f in spec.state_fields}
            else:
                views = {o: self.layouts[o].views(buffers[o]) for o in self.layouts}
                w = [views[self.w_obj][n] for n in names]
                g = [views[self.g_obj][n] for n in names]
                states = {
                    f: [views[self.o_obj][f"{n}/{f}"] for n in names] for f in spec.state_fields
                }
            if scale is not None:
                for grad in g:
                    grad.mul_(scale.to(grad.dtype))
            spec.update(
                self.tasks.ops(ctx.device),
                w,
                g,
                states,
                step=step,
                policy=policy,
                weight_decay=policy["weight_decay"] if decayed else 0.0,
                roles=[self.roles] * len(w),
            )
        if self.ruled:  # tensors moved by a rule from the layer's Aux, after the update
            views = self.layouts[self.w_obj].views(buffers[self.w_obj])
            aux = self.named(ctx, "aux")
            math = self.tasks.math(self.kind)
            env = self.env(ctx, aux=aux)
            math.apply_rules(self.tasks.config, {n: views[n] for n in self.ruled}, aux, env)

    def clip_factor(self, ctx: LaunchContext) -> torch.Tensor | None:
        """``min(1, clip / (norm + 1e-6))`` of the global norm (the ``gn`` objects summed in
        layer order, the same in every optimizer task), as ``clip_grad_norm_`` computes
        it; a device scalar, so nothing waits for the host. None without clipping."""
        clip = self.tasks.train.clip
        if clip is None:
            return None
        norms = [self.buffer(ctx, gn) for gn in self.slot.objects("grad_norm")]
        total = torch.stack([n.reshape(()) for n in norms]).sum().sqrt()
        return (clip / (total + 1e-6)).clamp(max=1.0)


def _number(value: Any, kind: type = float) -> Any:
    """A per-step value as the optimizer takes it: a Python number, or the device tensor
    the engine hands a replayed CUDA graph, left on the device."""
    return value if isinstance(value, torch.Tensor) else kind(value)


class GradNorm(_Exec):
    """A parameter group's squared gradient norm, in float32, into its ``gn`` object."""

    def launch(self, ctx: LaunchContext) -> None:
        views = self.named(ctx, "grad").values()
        norms = [torch.linalg.vector_norm(v, dtype=torch.float32) for v in views]
        self.one(ctx, "grad_norm").copy_(torch.stack(norms).square().sum())


class GradAllReduce(_Exec):
    """A fleet member's gradient of one parameter group, scaled by the member's token
    share (the task's ``share`` param) and summed over the default ``torch.distributed``
    process group, so every member ends with the token-weighted mean of the fleet's
    gradients (``dataflow_training.drive.fleet``). One collective over the group's tensors: in
    place over the packed gradient when its tensors share one dtype (the padding between
    them is zeros and stays so), else over a flattened copy. The task runs on the
    collective link (the engine's collective stream on CUDA, its own worker on CPU). The
    collective runs only when the run's values carry ``fleet`` (what ``TrainingRun.step``
    passes in a fleet): a launch outside a fleet step must not wait on members that are
    not launching it. Not capturable: gloo cannot be captured and the collective is kept
    out of CUDA graphs."""

    capturable = False

    def launch(self, ctx: LaunchContext) -> None:
        dw = self.slot.one("grad")
        layout = self.layout.packed[dw].layout
        flat = layout.span(self.buffer(ctx, dw), [e.name for e in layout.entries])
        views = None
        if flat is None:  # tensors of several dtypes: reduce a flattened copy
            views = list(self.named(ctx, "grad").values())
            flat = torch.cat([v.reshape(-1) for v in views])
        flat.mul_(float(self.task.params["share"]))
        if ctx.values.get("fleet"):
            dist.all_reduce(flat)
        offset = 0
        for v in views or ():
            v.copy_(flat[offset : offset + v.numel()].view_as(v))
            offset += v.numel()
