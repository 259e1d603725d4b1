"""The executables of a lowered update: the family's own block math, run on the views the
engine hands each task (``ctx.inputs``, ``ctx.mutates``, ``ctx.outputs``).

A block's recompute and backward run its math through a ``dataflow_training.drive.Strategy``
with the writes of what it returns into the task's views: on CUDA by default the torch
resolver's ``CompiledStrategy`` (each block kind's math and its writes compiled by
``torch.compile``, so a fused kernel stores a value where eager math would store it and a
copy would read and write it again). The head's two passes over each chunk's logits are
compiled with the same backend (``LogitPasses``); the embedding, the rest of the head and
AdamW run eagerly. Every executable reads nothing on the host where the update is built
for a captured step (``build(..., graph=True)``).

Per-run values (``ctx.values``): ``lr``, ``adam_step`` (1 for the first update), and
``kl_coef`` when the update has the KL term.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from dataflow_training import load_family
from dataflow_training.drive import Put, Strategy
from dataflow_training.kit import FINAL_NORM, LM_HEAD, Env, RowGradient, load_ops

from dataflow import DictResolver, LaunchContext
from dataflow_rl_example.loss import advantages, token_loss, token_weights
from dataflow_rl_example.program import STATS, UpdateOptions, UpdateStep, lower_update


def _named(ids: tuple[str, ...], views: Any) -> dict[str, Any]:
    return dict(zip(ids, views, strict=True))


class BlockMaths:
    """Each block kind's math as ``strategy`` runs it, made once per kind and shared by
    every task of the update (a compiled kind compiles once for all its blocks), and the
    head's logit passes. ``capture``: the engine captures the step into a CUDA graph, so
    no task may read a value on the host (``Head`` then takes every position)."""

    def __init__(self, family: Any, strategy: Strategy, capture: bool = False) -> None:
        self.family, self.strategy, self.capture = family, strategy, capture
        self._maths: dict[str, Any] = {}
        # the head's passes over a chunk's logits, compiled with the blocks' backend
        self.logits = LogitPasses(getattr(strategy, "backend", None))

    def __getitem__(self, kind: str) -> Any:
        if kind not in self._maths:
            self._maths[kind] = self.strategy.block_math(kind, self.family.math(kind))
        return self._maths[kind]


class LogitPasses:
    """The head's passes over a chunk's logits (chunk, vocab) in the weight's dtype: each
    row's float32 log-prob of its target, then the logits' gradient from the log-probs',
    ``d_logp * (onehot - softmax)``, in the logits' dtype.

    Eager: the float32 log-softmax is kept and turned into the gradient in place (8 bytes
    an entry at the peak, ``policy.workspace_estimate``). Compiled (``backend``): the
    logsumexp alone is kept, and each pass is one fused kernel over the logits (the
    one-hot from an index comparison, no scatter); eager's float32 passes took the head
    to 475 ms of l3_1b's 2.4 s update on the H100, against 262 ms planned (session 33)."""

    def __init__(self, backend: str | None = None) -> None:
        if backend is not None:
            self.forward = torch.compile(_fused_logp, backend=backend)
            self.backward = torch.compile(_fused_grad, backend=backend)
        else:
            self.forward, self.backward = _eager_logp, _eager_grad


def _eager_logp(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = logits.float().log_softmax(-1)
    return logp_all.gather(1, target).squeeze(1), logp_all


def _eager_grad(
    logits: torch.Tensor, logp_all: torch.Tensor, target: torch.Tensor, d_logp: torch.Tensor
) -> torch.Tensor:
    grad = logp_all.exp_().mul_(-d_logp[:, None])
    return grad.scatter_add_(1, target, d_logp[:, None]).to(logits.dtype)


def _fused_logp(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wide = logits.float()
    lse = torch.logsumexp(wide, -1)
    return wide.gather(1, target).squeeze(1) - lse, lse


def _fused_grad(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, d_logp: torch.Tensor
) -> torch.Tensor:
    vocab = torch.arange(logits.shape[1], device=logits.device)
    onehot = (vocab[None, :] == target).float()
    softmax = (logits.float() - lse[:, None]).exp()
    return ((onehot - softmax) * d_logp[:, None]).to(logits.dtype)


class _Task:
    """What every executable shares: the step, its ops, the tensors of a task by name.
    Each reads nothing on the host, so a CUDA graph can capture it (``Head`` only in its
    capture form)."""

    capturable = True

    def __init__(self, step: UpdateStep, ops: Any, maths: BlockMaths) -> None:
        self.step, self.config, self.maths = step, step.config, maths
        self.env = Env(ops, chunk_tokens=step.options.chunk_tokens)

    def tensors(self, ctx: LaunchContext) -> dict[str, Any]:
        """Every object of the task by id; packed objects as their named views."""
        task = ctx.task
        found = _named(task.inputs, ctx.inputs) | _named(task.mutates, ctx.mutates)
        found |= _named(task.outputs, ctx.outputs)
        packings = self.step.packings
        return {oid: packings[oid].views(t) if oid in packings else t for oid, t in found.items()}

    def params(self, tensors: dict[str, Any], layer: Any) -> dict[str, Any]:
        """Every parameter of ``layer`` by name (from each of its groups' objects)."""
        params: dict[str, Any] = {}
        for oid in self.step.param_objects(layer):
            params |= tensors[oid]
        return params

    def name(self, ctx: LaunchContext, oid: str) -> str:
        """The id of the task's round's object ``oid`` (``UpdateStep.each``)."""
        return self.step.each(oid, ctx.task.params.get("round", 0))

    def write_grads(
        self, ctx: LaunchContext, tensors: dict[str, Any], layer: Any, grads: dict[str, Any]
    ) -> None:
        """Write ``layer``'s gradients, or add them where the task accumulates them (a
        later round, or the token table's gradient that the tied head wrote)."""
        for oid in self.step.param_objects(layer):
            add = "d" + oid in ctx.task.mutates
            for name, target in tensors["d" + oid].items():
                grad = grads[name]
                if isinstance(grad, RowGradient):
                    (grad.add_into if add else grad.copy_into)(target)
                else:
                    target.add_(grad) if add else target.copy_(grad)


class Recompute(_Task):
    """A block's forward on its handed-over input: its saved context, router choices and
    (where nothing handed it over) its output."""

    def launch(self, ctx: LaunchContext) -> None:
        index = ctx.task.params["layer"]
        block = self.step.blocks[index]
        tensors = self.tensors(ctx)
        # forward returns (y, saved, aux_temp): each saved and aux_temp tensor into its view
        puts: list[Put] = [
            ((1, name), view, False, f"saved tensor {name}")
            for name, view in tensors[self.name(ctx, f"A_{index}")].items()
        ]
        puts += [
            ((2, name), view, False, f"aux_temp tensor {name}")
            for name, view in tensors.get(self.name(ctx, f"T_{index}"), {}).items()
        ]
        following = self.name(ctx, f"h_{index + 1}")
        if following in ctx.task.outputs:
            puts.append(((0,), tensors[following], False, "output"))
        self.maths.strategy.run_into(
            self.maths[block.kind],
            "forward",
            puts,
            self.config,
            self.params(tensors, block),
            tensors[self.name(ctx, f"h_{index}")],
            self.env,
        )


class Backward(_Task):
    def launch(self, ctx: LaunchContext) -> None:
        index = ctx.task.params["layer"]
        block = self.step.blocks[index]
        tensors = self.tensors(ctx)
        # backward returns (dx, grads): the gradients written, or added to in a later round
        puts: list[Put] = [((0,), tensors[self.name(ctx, f"dh_{index}")], False, "dx")]
        for oid in self.step.param_objects(block):
            add = "d" + oid in ctx.task.mutates
            puts += [
                ((1, name), view, add, f"gradient {name}")
                for name, view in tensors["d" + oid].items()
            ]
        self.maths.strategy.run_into(
            self.maths[block.kind],
            "backward",
            puts,
            self.config,
            self.params(tensors, block),
            tensors[self.name(ctx, f"h_{index}")],
            tensors[self.name(ctx, f"A_{index}")],
            tensors.get(self.name(ctx, f"T_{index}"), {}),
            tensors[self.name(ctx, f"dh_{index + 1}")],
            self.env,
        )


class Embed(_Task):
    def launch(self, ctx: LaunchContext) -> None:
        tensors, embed = self.tensors(ctx), self.step.layers[0]
        math = self.step.family.math(embed.kind)
        tokens = tensors[self.name(ctx, "tokens")]
        h = math.forward(self.config, self.params(tensors, embed), tokens, self.env)
        tensors[self.name(ctx, "h_0")].copy_(h)


class EmbedBackward(_Task):
    """The token table's gradient; added to the head's where the two share the table, and
    to the earlier rounds'."""

    def launch(self, ctx: LaunchContext) -> None:
        tensors, embed = self.tensors(ctx), self.step.layers[0]
        math = self.step.family.math(embed.kind)
        tokens, dh = tensors[self.name(ctx, "tokens")], tensors[self.name(ctx, "dh_0")]
        grads = math.backward(self.config, tokens, dh, self.env)
        self.write_grads(ctx, tensors, embed, grads)


class Head(_Task):
    """Final norm, then chunk by chunk over the scored tokens: logits, log-probs, the
    policy loss, and its gradient (no (tokens, vocab) tensor beyond one chunk). The loss is
    a function of each token's log-prob alone, so autograd over a (chunk,) vector gives
    ``d loss / d logp``; the logits' gradient is that times ``onehot - softmax``. Writes
    ``dh_L``, the head's gradients and ``stats`` (a later round adds its share to the
    gradients and ``stats``: each token's weight and the advantages come from every
    round's rows, so the rounds' shares sum to the whole batch's).

    For a captured step (``BlockMaths.capture``) the chunks are every position's, in
    order: which tokens are scored is then read on the device alone (an unscored token
    weighs nothing), where gathering the scored ones first reads their count on the host.
    It costs the unscored positions' logits (a prompt's)."""

    @property
    def capturable(self) -> bool:
        return self.maths.capture

    def launch(self, ctx: LaunchContext) -> None:
        step, options = self.step, self.step.options
        tensors, head, count = self.tensors(ctx), step.layers[-1], len(step.blocks)
        params = self.params(tensors, head)
        for local, target in head.tied.items():  # e.g. lm_head.weight -> emb's table
            layer_name, name = target.split(".", 1)
            owner = next(layer for layer in step.layers if layer.name == layer_name)
            params[local] = self.params(tensors, owner)[name]
        x = tensors[self.name(ctx, f"h_{count}")]
        first = "stats" in ctx.task.outputs  # round 0 writes; later rounds add
        norm = type(self.config).architecture.norm.op(
            self.config, FINAL_NORM.removesuffix(".weight")
        )
        hidden, norm_stats = norm.forward(self.env.ops, params, x)
        flat = hidden.reshape(-1, hidden.shape[-1])
        weight = params[LM_HEAD]
        # the whole batch's weights and advantages, then this round's rows of them
        start = ctx.task.params.get("round", 0) * step.round_rows
        mine = slice(start, start + step.round_rows)
        every = torch.cat([tensors[step.each("scored", r)] for r in range(step.rounds)])
        weights = token_weights(every, options.loss)[mine].reshape(-1)
        advantage = advantages(tensors["rewards"], tensors["groups"], options.loss)[mine]
        own = tensors[self.name(ctx, "scored")]
        scored = own.reshape(-1)
        advantage = advantage[:, None].expand_as(own).reshape(-1)
        behaviour = tensors[self.name(ctx, "behaviour")].reshape(-1)
        targets = tensors[self.name(ctx, "targets")].reshape(-1)
        ref = tensors[self.name(ctx, "ref")].reshape(-1) if options.kl else None
        kl_coef = ctx.values["kl_coef"] if options.kl else 0.0

        d_hidden = torch.zeros_like(flat, dtype=torch.float32)
        d_weight = self.grad_view(tensors, LM_HEAD)  # the output itself: no copy
        if first:
            d_weight.zero_()
        totals = torch.zeros(len(STATS), dtype=torch.float64, device=x.device)
        size, positions = options.chunk_tokens, flat.shape[0]
        if self.maths.capture:  # every position, in slices: nothing read on the host
            chunks: Any = [slice(at, min(at + size, positions)) for at in range(0, positions, size)]
        else:  # the scored positions alone
            chunks = scored.nonzero().reshape(-1).split(size)
        vocab = self.config.vocab_size
        for chunk in chunks:
            h, target = flat[chunk], targets[chunk, None]
            logits = torch.mm(h, weight[:vocab].T)  # (chunk, vocab), in the weight's dtype
            token, kept = self.maths.logits.forward(logits, target)
            keep = scored[chunk] > 0
            with torch.enable_grad():  # the loss's gradient by log-prob: a (chunk,) graph
                logp = token.requires_grad_()
                # an unscored token's ratio is 1 and its KL gap 0 (it weighs nothing: a
                # finite loss there keeps a zero weight's product zero, not NaN)
                logp_in = torch.where(keep, logp, behaviour[chunk])
                ref_in = None if ref is None else torch.where(keep, ref[chunk], logp_in)
                loss, ratio, kl = token_loss(
                    logp_in,
                    behaviour[chunk],
                    advantage[chunk],
                    clip_eps=options.clip_eps,
                    ref=ref_in,
                    kl_coef=kl_coef,
                )
                total = (loss * weights[chunk]).sum()
                (d_logp,) = torch.autograd.grad(total, logp)
            # d logp / d logits = onehot - softmax; in the weight's dtype: a float32 copy
            # of a bfloat16 table per chunk would be the largest temporary of the update
            d_logits = self.maths.logits.backward(logits, kept, target, d_logp)
            del logits, kept
            d_hidden[chunk] = torch.mm(d_logits, weight[:vocab]).float()
            d_weight[:vocab].addmm_(d_logits.T.to(d_weight.dtype), h.to(d_weight.dtype))
            clipped = ((ratio - 1).abs() > options.clip_eps) & keep
            kl_sum = (kl.detach() * keep).double().sum() if kl is not None else totals.new_zeros(())
            totals += torch.stack(
                [
                    total.detach().double(),
                    (ratio.detach() * keep).double().sum(),
                    clipped.double().sum(),
                    kl_sum,
                ]
            )
            # the chunk's logits' gradient goes before the next chunk's logits come: kept to
            # the loop's next turn, such a tensor was a third (chunk, vocab) one at the peak
            # (l3_1b's head: 1.69 GB against an estimate of 1.15, session 32)
            del d_logits
        count_scored = every.count_nonzero().clamp(min=1).double()  # on the device
        share = totals / torch.stack([count_scored.new_ones(()), *[count_scored] * 3])
        tensors["stats"].copy_(share) if first else tensors["stats"].add_(share)
        dx, grads = norm.backward(
            self.env.ops, params, x, norm_stats, d_hidden.view_as(hidden).to(x.dtype)
        )
        tensors[self.name(ctx, f"dh_{count}")].copy_(dx)
        for name, grad in grads.items():
            view = self.grad_view(tensors, name)
            view.copy_(grad) if first else view.add_(grad)

    def grad_view(self, tensors: dict[str, Any], name: str) -> Any:
        """The view of the head's gradient of parameter ``name`` (its local name: a tied
        one's is in the embedding's gradient object)."""
        head = self.step.layers[-1]
        layer_name, param = head.tied.get(name, f"{head.name}.{name}").split(".", 1)
        owner = next(layer for layer in self.step.layers if layer.name == layer_name)
        for oid in self.step.param_objects(owner):
            if param in tensors["d" + oid]:
                return tensors["d" + oid][param]
        raise KeyError(f"the head's task has no gradient of {name!r}")


#: elements of a parameter AdamW updates at once: its float32 temporaries (the slice's
#: parameter, moments, gradient and denominator) stay near 100 MB whatever the tensor. Whole
#: tensors made them 4-6 copies of the largest one: 5-6 GB for l3_1b's bfloat16 token table
#: (263M entries), which broke a 4 GiB budget on the H100 in session 31.
ADAMW_SLICE = 1 << 22


class AdamW(_Task):
    """AdamW on one parameter group (decoupled weight decay on tensors declared with
    ``decay``): ``lr`` and ``adam_step`` from the run's values, a slice of each tensor at a
    time (``ADAMW_SLICE``). The values are numbers, or 0-d device tensors where the engine
    captures the step (``Engine(graph=True)``): the bias corrections are then device math,
    none of it read on the host."""

    def launch(self, ctx: LaunchContext) -> None:
        oid = ctx.task.params["object"]
        tensors = self.tensors(ctx)
        params, grads, moments = tensors[oid], tensors["d" + oid], tensors["O" + oid[1:]]
        layer = next(layer for layer in self.step.layers if oid in self.step.param_objects(layer))
        decays = {p.name: p.decay for p in self.step.param_objects(layer)[oid].params}
        options = self.step.options
        (beta1, beta2), lr, t = options.betas, ctx.values["lr"], ctx.values["adam_step"]
        on_device = isinstance(lr, torch.Tensor) or isinstance(t, torch.Tensor)
        if not on_device:
            lr, t = float(lr), int(t)
        decay = 1 - lr * options.weight_decay
        step_size, correction = lr / (1 - beta1**t), 1 - beta2**t
        for name, grad in grads.items():
            stored = (params[name], moments[f"m.{name}"], moments[f"v.{name}"])
            flat = [x.view(-1) for x in (*stored, grad)]
            # float32 math on ADAMW_SLICE elements at a time: a bfloat16 parameter or moment
            # is rounded once, when written back (.float() of a float32 slice is the slice
            # itself: updated in place)
            for start in range(0, flat[0].numel(), ADAMW_SLICE):
                part = slice(start, start + ADAMW_SLICE)
                param, m, v, g = (x[part].float() for x in flat)
                if decays[name] and options.weight_decay:
                    param.mul_(decay)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v / correction).sqrt_().add_(options.eps)
                if on_device:  # addcdiv's value must be a number
                    param.sub_(denom.reciprocal_().mul_(m).mul_(step_size))
                else:
                    param.addcdiv_(m, denom, value=-step_size)
                for target, value in zip(flat[:3], (param, m, v), strict=True):
                    if value.data_ptr() != target[part].data_ptr():
                        target[part].copy_(value)


def strategy(device: str = "cpu", compiled: str | None = "auto") -> Strategy:
    """How the blocks' math runs: ``compiled`` ``"auto"`` compiles it (inductor) on CUDA
    and runs it eagerly elsewhere, None always eagerly, any other value is the
    ``torch.compile`` backend to compile it with (the CPU tests take ``aot_eager``)."""
    if compiled == "auto":
        compiled = "inductor" if torch.device(device).type == "cuda" else None
    if compiled is None:
        return Strategy()
    from dataflow_resolver_torch import CompiledStrategy

    return CompiledStrategy(compiled)


def build(
    step: UpdateStep, device: str = "cpu", compiled: str | None = "auto", *, graph: bool = False
) -> DictResolver:
    """The resolver of a lowered update's tasks (``compiled``: ``strategy``'s; ``graph``:
    for an engine that captures the step, ``BlockMaths.capture``)."""
    ops = load_ops(device, step.family.ops)
    maths = BlockMaths(step.family, strategy(device, compiled), capture=graph)
    kinds = {
        "rl.recompute": Recompute,
        "rl.backward": Backward,
        "rl.embed": Embed,
        "rl.embed_backward": EmbedBackward,
        "rl.head": Head,
        "rl.adamw": AdamW,
    }
    return DictResolver(
        "rl-update", {key: _factory(cls, step, ops, maths) for key, cls in kinds.items()}
    )


@contextmanager
def task_temporaries() -> Iterator[dict[str, int]]:
    """On CUDA, within the block: each update task's temporaries by task id, the device
    allocator's peak during its launch above the bytes in use before it (the caching
    allocator counts a tensor as its kernel is enqueued: no synchronisation). The largest
    is what ``PolicyTrainer(workspace_bytes=)`` must cover. Peaks are reset at each launch,
    so the engine's own budget check sees only the last task's: measure, then run apart."""
    found: dict[str, int] = {}
    kinds = (Recompute, Backward, Embed, EmbedBackward, Head, AdamW)
    launches = {kind: kind.__dict__["launch"] for kind in kinds}

    def watched(launch: Any) -> Any:
        def launch_watched(self: _Task, ctx: LaunchContext) -> None:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            launch(self, ctx)
            found[ctx.task.id] = torch.cuda.max_memory_allocated() - before

        return launch_watched

    for kind, launch in launches.items():
        kind.launch = watched(launch)
    try:
        yield found
    finally:
        for kind, launch in launches.items():
            kind.launch = launch


def build_from_program(program: Any) -> DictResolver:
    """The resolver of an update's program written out (``dataflow-rl lower``): the family,
    config, shape and options are in its metadata, and lowering them again must give the
    program's own tasks."""
    meta = program.metadata
    if meta.get("example") != "rl_training":
        raise ValueError(f"program {program.name!r} is not an RL update (dataflow-rl lower)")
    family = load_family(meta["family"])
    config = family.config_from_hf(meta["config"], f"program {program.name!r} metadata")
    options = meta["options"] | {"betas": tuple(meta["options"]["betas"])}
    step = lower_update(
        family,
        config,
        rows=meta["rows"],
        length=meta["length"],
        hidden_layers=tuple(meta["hidden_layers"]),
        options=UpdateOptions(**options),
    )
    if [t.id for t in step.program.tasks] != [t.id for t in program.tasks]:
        raise ValueError(f"program {program.name!r}: its tasks are not the update's")
    return build(step)


def _factory(cls: type, step: UpdateStep, ops: Any, maths: BlockMaths) -> Any:
    return lambda task: cls(step, ops, maths)
