"""Lower a family + TrainConfig into a Program (ARCHITECTURE.md section 7).

Tasks, in chain order, for step ``s`` (ids ``{kind}_{s}_{round}_{layer}``):

    for each round r:  embed_s_r_emb, fwd_s_r_0 .. fwd_s_r_{L-1}, head_s_r_head,
                       [rec_s_r_i before bwd_s_r_i where recompute is chosen]
                       bwd_s_r_{L-1} .. bwd_s_r_0, embbwd_s_r_emb
    then:              opt_s_{R-1}_{layer} for head, L-1 .. 0, emb

Objects: ``W_n`` (parameters, packed), ``dW_n`` (gradients: round 0 creates them, later
rounds mutate), ``O_n`` (optimizer state), ``A_s_r_i`` (saved activations of block i),
hidden states ``y_s_r_i`` (``y_s_r_0`` is the embedding; block i makes ``y_s_r_{i+1}``),
gradients ``dy_s_r_i``, tokens ``x_s_r``, targets ``t_s_r``, losses ``loss_s_r``.
Layouts of the packed objects ride in ``program.metadata["layouts"]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

from dataflow.schema import Links, Obj, Program, Role, Task, TensorMeta
from dataflow_training.config import TrainConfig
from dataflow_training.costs import RooflineCost
from dataflow_training.family import Family, LayerSpec
from dataflow_training.layout import Layout
from dataflow_training.optimizers import optimizer_spec

OPTIMIZER_KEY = "optim.{name}"


@attrs.frozen
class Lowered:
    """The program plus what a resolver needs to run it."""

    program: Program
    layers: tuple[LayerSpec, ...]


def _grad(obj: str, round_: int) -> dict[str, tuple[str, ...]]:
    """Round 0 creates a gradient object; later rounds accumulate into it."""
    return {"outputs": (obj,)} if round_ == 0 else {"mutates": (obj,)}


def _param_dtype(spec_dtype: str, policy_dtype: str) -> str:
    return policy_dtype if spec_dtype == "param" else spec_dtype


def lower(
    family: Family,
    preset: str,
    train: TrainConfig,
    *,
    overrides: dict[str, Any] | None = None,
    step: int = 0,
    recompute: Iterable[int] = (),
    cost: RooflineCost | None = None,
    links: Links | None = None,
    keep_grads: bool = False,
) -> Lowered:
    """The Program of one training step of ``family``'s ``preset`` (with ``overrides``).

    ``recompute``: block indices whose saved activations are not kept from forward but
    re-derived just before their backward (the declared recompute rewrite).
    ``keep_grads``: the step's weight gradients must end in slow memory too (for checks
    that read them back; normally they die with the optimizer tasks).
    """
    overrides = dict(overrides or {})
    config = family.config(preset, **overrides)
    cost = cost or RooflineCost()
    recompute = frozenset(recompute)
    layers = tuple(family.layers(config))
    blocks = [layer for layer in layers if layer.kind not in ("embed", "head")]
    embed = next(layer for layer in layers if layer.kind == "embed")
    head = next(layer for layer in layers if layer.kind == "head")
    unknown = sorted(i for i in recompute if not 0 <= i < len(blocks))
    if unknown:
        raise ValueError(f"recompute names block(s) {unknown}; the model has {len(blocks)}")
    policy = train.dtype
    optimizer = optimizer_spec(train.optimizer.name)
    fields = set(train.optimizer.state_dtypes)
    if fields != set(optimizer.state_fields):
        raise ValueError(
            f"optimizer.state_dtypes names {sorted(fields)}; optimizer {optimizer.name!r} "
            f"keeps {sorted(optimizer.state_fields)}"
        )
    layouts: dict[str, Layout] = {}
    objects: list[Obj] = []

    def packed(obj_id: str, role: Role, layout: Layout, location: str = "slow") -> None:
        layouts[obj_id] = layout
        objects.append(Obj(obj_id, layout.size_bytes, role, location))

    for layer in layers:
        params = [(p.name, p.shape, _param_dtype(p.dtype, policy.param)) for p in layer.params]
        grads = [(p.name, p.shape, _param_dtype(p.dtype, policy.grad)) for p in layer.params]
        states = [
            (f"{p.name}/{field}", p.shape, dtype)
            for p in layer.params
            for field in optimizer.state_fields
            for dtype in (train.optimizer.state_dtypes[field],)
        ]
        # The first task (embed) uses W_emb: nothing could prefetch it in time.
        packed(
            f"W_{layer.name}", Role.PARAM, Layout.pack(params), "fast" if layer is embed else "slow"
        )
        packed(f"dW_{layer.name}", Role.GRAD, Layout.pack(grads))
        packed(f"O_{layer.name}", Role.OPT_STATE, Layout.pack(states))

    hidden = TensorMeta(policy.activation, family.hidden_shape(config, train.batch, train.seq_len))
    tokens = TensorMeta("int64", (train.batch, train.seq_len))
    saved_layout: dict[str, Layout] = {}
    for kind in {layer.kind for layer in blocks}:
        specs = family.math(kind).saved_specs(config, train.batch, train.seq_len)
        saved_layout[kind] = Layout.pack(
            (s.name, s.shape, _param_dtype(s.dtype, policy.activation)) for s in specs
        )
    layouts.update({f"A:{kind}": layout for kind, layout in saved_layout.items()})

    tasks: list[Task] = []
    n_blocks = len(blocks)
    sizes = {layer.name: layouts[f"W_{layer.name}"].size_bytes for layer in layers}
    params_count = {layer.name: sum(math.prod(p.shape) for p in layer.params) for layer in layers}
    tokens_n = train.tokens_per_round
    act_bytes = hidden.nbytes
    common = {"family": family.name, "step": step}

    def task(kind: str, r: int, layer: str, key: str, **fields: Any) -> Task:
        params = {**common, "round": r, "layer": layer, **fields.pop("params", {})}
        return Task(f"{kind}_{step}_{r}_{layer}", kind, key, params=params, **fields)

    for r in range(train.rounds):
        x, t = f"x_{step}_{r}", f"t_{step}_{r}"
        objects += [
            Obj(x, tokens.nbytes, Role.DATA, "fast" if r == 0 else "slow", tokens),
            Obj(t, tokens.nbytes, Role.DATA, "slow", tokens),
            Obj(f"loss_{step}_{r}", 4, Role.OUTPUT, tensor=TensorMeta("float32", ())),
        ]
        y = [f"y_{step}_{r}_{i}" for i in range(n_blocks + 1)]
        dy = [f"dy_{step}_{r}_{i}" for i in range(n_blocks + 1)]
        objects += [Obj(name, hidden.nbytes, Role.ACTIVATION, tensor=hidden) for name in y]
        objects += [Obj(name, hidden.nbytes, Role.GRAD, tensor=hidden) for name in dy]
        saved = {}
        for i, block in enumerate(blocks):
            saved[i] = f"A_{step}_{r}_{i}"
            objects.append(Obj(saved[i], saved_layout[block.kind].size_bytes, Role.ACTIVATION))

        tasks.append(
            task(
                "embed",
                r,
                embed.name,
                f"{family.name}.embed.forward",
                inputs=(x, f"W_{embed.name}"),
                outputs=(y[0],),
                cost_us=cost.cost_us(0, 2 * act_bytes),
            )
        )
        for i, block in enumerate(blocks):
            keep = i not in recompute
            flops = 2 * tokens_n * params_count[block.name]
            tasks.append(
                task(
                    "fwd",
                    r,
                    block.name,
                    f"{family.name}.{block.kind}.forward",
                    inputs=(y[i], f"W_{block.name}"),
                    outputs=(y[i + 1], saved[i]) if keep else (y[i + 1],),
                    params={"kind": block.kind, "save": keep},
                    cost_us=cost.cost_us(flops, sizes[block.name] + 2 * act_bytes),
                )
            )
        vocab_flops = 6 * tokens_n * params_count[embed.name]  # tied projection, fwd + bwd
        head_grads = _grad(f"dW_{head.name}", r)
        head_inputs = (y[n_blocks], t, f"W_{head.name}")
        head_mut = head_grads.get("mutates", ())
        head_out = (f"loss_{step}_{r}", dy[n_blocks], *head_grads.get("outputs", ()))
        if family.tied():
            head_inputs += (f"W_{embed.name}",)
            embed_grad = _grad(f"dW_{embed.name}", r)
            head_out += embed_grad.get("outputs", ())
            head_mut += embed_grad.get("mutates", ())
        tasks.append(
            task(
                "head",
                r,
                head.name,
                f"{family.name}.head.loss",
                inputs=head_inputs,
                outputs=head_out,
                mutates=head_mut,
                params={"chunk_tokens": train.chunk_tokens},
                cost_us=cost.cost_us(vocab_flops, sizes[embed.name] + 2 * act_bytes),
            )
        )
        for i in reversed(range(n_blocks)):
            block = blocks[i]
            if i in recompute:
                flops = 2 * tokens_n * params_count[block.name]
                tasks.append(
                    task(
                        "rec",
                        r,
                        block.name,
                        f"{family.name}.{block.kind}.recompute",
                        inputs=(y[i], f"W_{block.name}"),
                        outputs=(saved[i],),
                        params={"kind": block.kind},
                        cost_us=cost.cost_us(flops, sizes[block.name] + 2 * act_bytes),
                    )
                )
            flops = 4 * tokens_n * params_count[block.name]
            grads = _grad(f"dW_{block.name}", r)
            tasks.append(
                task(
                    "bwd",
                    r,
                    block.name,
                    f"{family.name}.{block.kind}.backward",
                    inputs=(dy[i + 1], y[i], saved[i], f"W_{block.name}"),
                    outputs=(dy[i], *grads.get("outputs", ())),
                    mutates=grads.get("mutates", ()),
                    params={"kind": block.kind},
                    cost_us=cost.cost_us(flops, 2 * sizes[block.name] + 3 * act_bytes),
                )
            )
        embed_grad = (
            {"mutates": (f"dW_{embed.name}",)}
            if family.tied() or r > 0
            else {"outputs": (f"dW_{embed.name}",)}
        )
        tasks.append(
            task(
                "embbwd",
                r,
                embed.name,
                f"{family.name}.embed.backward",
                inputs=(dy[0], x),
                **embed_grad,
                cost_us=cost.cost_us(0, 2 * sizes[embed.name] + act_bytes),
            )
        )

    last = train.rounds - 1
    optimizer_key = OPTIMIZER_KEY.format(name=train.optimizer.name)
    for layer in (head, *reversed(blocks), embed):
        moved = 2 * (sizes[layer.name] + layouts[f"O_{layer.name}"].size_bytes) + sizes[layer.name]
        tasks.append(
            task(
                "opt",
                last,
                layer.name,
                optimizer_key,
                inputs=(f"dW_{layer.name}",),
                mutates=(f"W_{layer.name}", f"O_{layer.name}"),
                cost_us=cost.cost_us(0, moved),
            )
        )
    finals = {f"W_{layer.name}": "slow" for layer in layers}
    finals |= {f"O_{layer.name}": "slow" for layer in layers}
    finals |= {f"loss_{step}_{r}": "slow" for r in range(train.rounds)}
    if keep_grads:
        finals |= {f"dW_{layer.name}": "slow" for layer in layers}
    metadata = {
        "training": {
            "family": family.name,
            "preset": preset,
            "overrides": overrides,
            "train": attrs.asdict(train),
            "layers": [[layer.name, layer.kind] for layer in layers],
            "decay": {layer.name: [p.name for p in layer.params if p.decay] for layer in layers},
        },
        "layouts": {name: layout.to_dict() for name, layout in layouts.items()},
    }
    program = Program(
        name=f"{family.name}-{preset}-train",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations=finals,
        links=links or Links(),
        metadata=metadata,
    )
    return Lowered(program, layers)
