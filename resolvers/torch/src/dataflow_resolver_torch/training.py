"""Executables for every compute key the training lowering emits.

Each executable unpacks its task's packed objects (``W_n``, ``dW_n``, ``O_n``, ``A_...``)
through the layouts in the program's metadata, calls the family's math with ops from the
kernel registry, and writes only into the task's outputs and mutates. Gradients of a
step are averaged over its accumulation rounds: the head scales what it sends back by
``1 / rounds``.
"""

from __future__ import annotations

from typing import Any

import torch
from dataflow_training.layout import Layout
from dataflow_training.ops import load_ops
from dataflow_training.optimizers import optimizer_spec

from dataflow.engine import LaunchContext
from dataflow.schema import Program, Task


class TrainingContext:
    """What every executable of one program shares: family, config, layouts, ops."""

    def __init__(self, program: Program, family: Any = None, ops: Any = None) -> None:
        meta = program.metadata.get("training")
        if meta is None:
            raise KeyError(
                "the program has no metadata['training']: it was not lowered by dataflow-training"
            )
        if family is None:
            from dataflow.plugins import families

            family = families().get(meta["family"]).load()
        self.family = family
        self.config = self.family.config(meta["preset"], **meta["overrides"])
        train = meta["train"]
        self.rounds = train["rounds"]
        self.optimizer = train["optimizer"]
        self.layouts = {k: Layout.from_dict(v) for k, v in program.metadata["layouts"].items()}
        self.decay = {layer: set(names) for layer, names in meta["decay"].items()}
        self.kinds = dict(meta["layers"])
        self._ops: dict[str, dict[str, Any]] = {}
        self._given_ops = ops

    def ops(self, device: str) -> dict[str, Any]:
        if self._given_ops is not None:
            return self._given_ops
        if device not in self._ops:
            self._ops[device] = load_ops(device)
        return self._ops[device]

    def unpack(self, obj_id: str, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layouts[obj_id].views(buffer)

    def saved(self, kind: str, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layouts[f"A:{kind}"].views(buffer)


def _store(
    targets: dict[str, torch.Tensor],
    values: dict[str, torch.Tensor],
    *,
    add: bool,
    scale: float = 1.0,
) -> None:
    """Write (or, with ``add``, accumulate) ``values`` into same-named ``targets``. A target
    with no value gets nothing when accumulating and zeros when written: an output must be
    fully written (the tied head, say, gives the embedding's ``wte`` gradient but not its
    ``wpe`` one)."""
    for name, target in targets.items():
        value = values.get(name)
        if value is None:
            if not add:
                target.zero_()
            continue
        if scale != 1.0:
            value = value * scale
        if add:
            target.add_(value.to(target.dtype))
        else:
            target.copy_(value)


class _Exec:
    def __init__(self, shared: TrainingContext, task: Task) -> None:
        self.shared, self.task = shared, task
        self.layer = task.params["layer"]
        self.kind = shared.kinds[self.layer]

    def weights(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.shared.unpack(f"W_{self.layer}", buffer)

    def grad_targets(self, ctx: LaunchContext, layer: str) -> tuple[dict[str, torch.Tensor], bool]:
        """The views of dW_<layer> in ctx, and whether this task accumulates into it."""
        name = f"dW_{layer}"
        if name in self.task.outputs:
            return self.shared.unpack(name, ctx.outputs[self.task.outputs.index(name)]), False
        return self.shared.unpack(name, ctx.mutates[self.task.mutates.index(name)]), True


class EmbedForward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        tokens, w = ctx.inputs
        (y,) = ctx.outputs
        math = self.shared.family.math("embed")
        y.copy_(
            math.forward(self.shared.config, self.weights(w), tokens, self.shared.ops(ctx.device))
        )


class EmbedBackward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        dy, tokens = ctx.inputs
        targets, add = self.grad_targets(ctx, self.layer)
        math = self.shared.family.math("embed")
        grads = math.backward(self.shared.config, tokens, dy, self.shared.ops(ctx.device))
        _store(targets, grads, add=add)


class BlockForward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        x, w = ctx.inputs
        math = self.shared.family.math(self.kind)
        y, saved = math.forward(self.shared.config, self.weights(w), x, self.shared.ops(ctx.device))
        ctx.outputs[0].copy_(y)
        if self.task.params.get("save", True):
            _store(self.shared.saved(self.kind, ctx.outputs[1]), saved, add=False)


class BlockRecompute(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        x, w = ctx.inputs
        math = self.shared.family.math(self.kind)
        saved = math.recompute(self.shared.config, self.weights(w), x, self.shared.ops(ctx.device))
        _store(self.shared.saved(self.kind, ctx.outputs[0]), saved, add=False)


class BlockBackward(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        dy, x, saved_buffer, w = ctx.inputs
        math = self.shared.family.math(self.kind)
        saved = self.shared.saved(self.kind, saved_buffer)
        dx, grads = math.backward(
            self.shared.config, self.weights(w), x, saved, dy, self.shared.ops(ctx.device)
        )
        ctx.outputs[0].copy_(dx)
        targets, add = self.grad_targets(ctx, self.layer)
        _store(targets, grads, add=add)


class HeadLoss(_Exec):
    def launch(self, ctx: LaunchContext) -> None:
        task, shared = self.task, self.shared
        x, targets_tokens, w_head = ctx.inputs[:3]
        embed_layer = next(name for name, kind in shared.kinds.items() if kind == "embed")
        embed_params = (
            self.shared.unpack(f"W_{embed_layer}", ctx.inputs[3]) if len(ctx.inputs) > 3 else {}
        )
        math = shared.family.math("head")
        loss, dx, head_grads, embed_grads = math.forward_backward(
            shared.config,
            self.weights(w_head),
            embed_params,
            x,
            targets_tokens,
            task.params["chunk_tokens"],
            shared.ops(ctx.device),
        )
        scale = 1.0 / shared.rounds  # the step's loss is the mean over its rounds
        ctx.outputs[0].copy_(loss)
        ctx.outputs[1].copy_(dx * scale)
        targets, add = self.grad_targets(ctx, self.layer)
        _store(targets, head_grads, add=add, scale=scale)
        if embed_grads:
            targets, add = self.grad_targets(ctx, embed_layer)
            _store(targets, embed_grads, add=add, scale=scale)


class OptimizerStep(_Exec):
    """One update of every parameter of a layer by the optimizer the key names."""

    def __init__(self, shared: TrainingContext, task: Task, spec: Any) -> None:
        super().__init__(shared, task)
        self.spec = spec

    def launch(self, ctx: LaunchContext) -> None:
        shared = self.shared
        (grad_buffer,) = ctx.inputs
        w_buffer, o_buffer = ctx.mutates
        grads = shared.unpack(f"dW_{self.layer}", grad_buffer)
        states = shared.unpack(f"O_{self.layer}", o_buffer)
        ops = shared.ops(ctx.device)
        step = int(ctx.values.get("step", 0)) + 1
        for name, param in self.weights(w_buffer).items():
            self.spec.update(
                ops,
                param,
                grads[name],
                {field: states[f"{name}/{field}"] for field in self.spec.state_fields},
                step=step,
                policy=shared.optimizer,
                decay=name in shared.decay[self.layer],
            )


_PHASES = {
    ("embed", "forward"): EmbedForward,
    ("embed", "backward"): EmbedBackward,
    ("head", "loss"): HeadLoss,
}
_BLOCK_PHASES = {"forward": BlockForward, "recompute": BlockRecompute, "backward": BlockBackward}


class TrainingResolver:
    """``Resolver`` for programs lowered by dataflow-training; dispatch by compute key."""

    name = "torch"

    def __init__(self, program: Program, *, family: Any = None, ops: Any = None) -> None:
        """``family`` and ``ops`` default to the registered family named in the program and
        the kernel registry's ops; tests pass their own."""
        self.shared = TrainingContext(program, family, ops)
        self.family_name = self.shared.family.name

    def __call__(self, task: Task):
        key = task.compute_key
        if key.startswith("optim."):
            try:
                spec = optimizer_spec(key.removeprefix("optim."))
            except ValueError as exc:
                raise KeyError(str(exc)) from None
            return OptimizerStep(self.shared, task, spec)
        family, _, rest = key.partition(".")
        kind, _, phase = rest.partition(".")
        if family != self.family_name:
            raise KeyError(f"compute key {key!r} is not of family {self.family_name!r}")
        if (kind, phase) in _PHASES:
            return _PHASES[(kind, phase)](self.shared, task)
        if phase in _BLOCK_PHASES and kind in set(self.shared.kinds.values()):
            return _BLOCK_PHASES[phase](self.shared, task)
        raise KeyError(
            f"no executable for {key!r}; known: embed.forward, embed.backward, head.loss, "
            "<block kind>.forward|recompute|backward, optim.<optimizer>"
        )
