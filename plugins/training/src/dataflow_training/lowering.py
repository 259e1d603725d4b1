"""Lower a family + TrainConfig into a Program and its typed step layout.

Tasks, in chain order, for step ``s`` (ids ``{kind}_{s}_{round}_{layer}``), with
``TrainConfig.order == "round"``:

    for each round r:  embed_s_r_emb, fwd_s_r_0 .. fwd_s_r_{L-1}, head_s_r_head,
                       [rec_s_r_i before bwd_s_r_i where recompute or a partial
                        save is chosen]
                       bwd_s_r_{L-1} .. bwd_s_r_0, embbwd_s_r_emb
    then:              one opt_s_{R-1}_<layer>[.<group>] per trainable parameter group,
                       head, blocks L-1 .. 0, emb

With ``order == "layer"`` the same tasks run layer by layer, each layer over every round
(rounds ascending): embed_s_*_emb, fwd_s_*_0, .., fwd_s_*_{L-1}, head_s_*_head, then
[rec_s_r_i,] bwd_s_r_i for every round of block L-1 down to block 0, embbwd_s_*_emb, then
the optimizer tasks as above. ``order == "layer:K"`` does that for rounds 0..K-1, then for
rounds K..2K-1, and so on, before the optimizer tasks.

With early updates (``TrainConfig.updates``: by default in layer orders) and no
all-reduce, each optimizer task then moves to right after the last task that touches its
group's weights or gradient (``_updates_after_last_use``): with layer order, the last
round's backward of its layer; with round order, opt_s_{R-1}_i follows bwd_s_{R-1}_i.

When the step measures its gradient norm (``TrainConfig.clip`` or ``grad_norm``), a
``gnorm_s_{R-1}_<layer>[.<group>]`` task follows the task that completes each group's
last-round gradient and writes its squared norm ``gn_s_<layer>[.<group>]``; with
``clip`` every optimizer task reads all of them (role ``grad_norm``) and scales its
group's gradient in place (``dW`` becomes a mutate) by the one global clip factor.

Everything that exists at the start (parameters, optimizer state, Aux, every round's
tokens and targets) starts in slow memory; the planner's prologue fetches what the first
tasks need. Objects (see ``dataflow_training.family`` for what each holds): ``W``/``dW``/``O`` per
parameter group (gradients: round 0 creates them, later rounds accumulate), ``Aux_i`` (or
``Aux_<kind>``, shared by a kind's layers; the step's first forward to touch an Aux
object zeroes it: its task's ``zero_aux`` param),
per round ``A_s_r_i`` (with a partial save ``p``: only the tensors it keeps, and
``A_s_r_i.p`` the others, which its ``rec`` task re-derives from them) and
``AuxTemp_s_r_i``, hidden states ``y_s_r_i`` (``y_s_r_0`` is
the embedding; block i makes ``y_s_r_{i+1}``), their gradients ``dy_s_r_i``, tokens
``x_s_r``, targets ``t_s_r``, losses ``loss_s_r``. Task inputs by role and every packed
object's layout are in the returned ``StepLayout``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from dataflow.schema import Link, Links, Obj, Program, Resource, Role, Task, TensorMeta
from dataflow_training.config import TrainConfig
from dataflow_training.costs import RooflineCost
from dataflow_training.family import (
    Family,
    FamilyContractError,
    LayerSpec,
    PartialSave,
    TensorSpec,
    Work,
    embed_layer,
    head_layer,
    partial_saves,
)
from dataflow_training.keys import GRAD_ALLREDUCE_KEY, GRAD_NORM_KEY, family_key, optimizer_key
from dataflow_training.layout import Layout
from dataflow_training.optimizers import optimizer_spec
from dataflow_training.step import ROLES, LayerInfo, PackedObject, StepLayout, TaskSlot


@attrs.frozen
class Lowered:
    """The program plus its typed step layout."""

    program: Program
    layout: StepLayout
    layers: tuple[LayerSpec, ...]


def group_name(layer: str, group: str) -> str:
    """``3`` for a layer's main group, ``3.experts`` for a named one."""
    return f"{layer}.{group}" if group else layer


def group_object(prefix: str, layer: str, group: str) -> str:
    """``W_3`` for a layer's main group, ``W_3.experts`` for a named one."""
    return f"{prefix}_{group_name(layer, group)}"


def _dtype(spec: TensorSpec, policy_dtype: str) -> str:
    return policy_dtype if spec.dtype == "policy" else spec.dtype


def _ordered(params: Iterable[TensorSpec]) -> list[TensorSpec]:
    """Trainable with decay, trainable without, then frozen: each class one span."""
    params = list(params)
    return (
        [p for p in params if p.trainable and p.decay]
        + [p for p in params if p.trainable and not p.decay]
        + [p for p in params if not p.trainable]
    )


#: The collective link of a fleet step lowered without one (``lower``'s ``links`` has no
#: ``collective``): assumed, not measured, 1 GB/s and 100 us, about gloo over loopback on
#: a CPU; a fleet on GPUs passes its link from the hardware table
#: (``HardwareEntry.collective_link``).
ASSUMED_COLLECTIVE = Link(bw_bytes_per_us=1000.0, latency_us=100.0)


def lower(
    family: Family,
    preset: str,
    train: TrainConfig,
    *,
    overrides: dict[str, Any] | None = None,
    step: int = 0,
    recompute: Iterable[int | tuple[int, int]] = (),
    partial: Mapping[int | tuple[int, int], str] | None = None,
    cost: RooflineCost | None = None,
    links: Links | None = None,
    keep_grads: bool = False,
    keep_aux_temp: bool = False,
    grad_share: float | None = None,
) -> Lowered:
    """The Program of one training step of ``family``'s ``preset`` (with ``overrides``).

    ``recompute``: blocks whose saved activations are not kept from forward but
    re-derived just before their backward (the declared recompute rewrite): a block index
    means that block in every round, a ``(round, block)`` pair that round only.
    ``partial``: blocks (named the same way) whose forward keeps only part of ``A``, each
    mapped to the name of the partial save its kind declares
    (``BlockMath.partial_saves``); their ``rec`` task re-derives the rest into
    ``A_s_r_i.<name>`` and backward reads both. A unit is in ``recompute`` or ``partial``,
    not both.
    ``keep_grads``: the step's weight gradients must end in slow memory too (for checks
    that read them back; normally they die with the optimizer tasks).
    ``keep_aux_temp``: every round's AuxTemp (the blocks' recorded decisions, such as the
    router's expert choices) must end in slow memory too, for checks that read them back.
    ``grad_share``: this step is one member of a data-parallel fleet whose tokens are this
    share of the fleet's; an ``allreduce`` task per trainable group follows the task that
    completes the group's last-round gradient (before its ``gnorm``), scales it by the
    share and sums it over the fleet (``dataflow_training.fleet``). Those tasks run on the
    collective link (``links.collective``; ``ASSUMED_COLLECTIVE`` when ``links`` has
    none), so each group's all-reduce overlaps the backward of the layers below it.
    """
    overrides = dict(overrides or {})
    config = family.config(preset, **overrides)
    cost = cost or RooflineCost()
    layers = tuple(family.layers(config))
    embed, head = embed_layer(layers), head_layer(layers)
    if layers[0] is not embed or layers[-1] is not head:
        raise FamilyContractError(
            f"family {family.name!r}: layers must run embed, blocks..., head; got "
            f"{[layer.kind for layer in layers]}"
        )
    blocks = list(layers[1:-1])
    recompute = recompute_units(recompute, train.rounds, len(blocks))
    partial_of = _partial_units(partial or {}, train.rounds, len(blocks), recompute)
    by_name = {layer.name: layer for layer in layers}
    if len(by_name) != len(layers):
        raise FamilyContractError(f"family {family.name!r}: layer names repeat")
    policy = train.dtype
    optimizer = optimizer_spec(train.optimizer.name)
    fields = set(train.optimizer.state_dtypes)
    if fields != set(optimizer.state_fields):
        raise ValueError(
            f"optimizer.state_dtypes names {sorted(fields)}; optimizer {optimizer.name!r} "
            f"keeps {sorted(optimizer.state_fields)}"
        )

    packed: dict[str, PackedObject] = {}
    objects: list[Obj] = []

    def add_packed(obj: PackedObject, role: Role, location: str = "slow") -> None:
        packed[obj.id] = obj
        objects.append(Obj(obj.id, obj.layout.size_bytes, role, location))

    weights: dict[str, tuple[str, ...]] = {}  # layer -> its W objects
    grads: dict[str, tuple[str, ...]] = {}  # layer -> its dW objects (trainable groups)
    param_bytes: dict[str, int] = {}
    for layer in layers:
        weights[layer.name], grads[layer.name] = (), ()
        for group in layer.groups:
            params = _ordered(group.params)
            trainable = [p for p in params if p.trainable]
            w_id = group_object("W", layer.name, group.name)
            w_layout = Layout.pack((p.name, p.shape, _dtype(p, policy.param)) for p in params)
            add_packed(
                PackedObject(
                    w_id,
                    "W",
                    layer.name,
                    w_layout,
                    group.name,
                    tuple(p.name for p in trainable if p.decay),
                ),
                Role.PARAM,
            )
            weights[layer.name] += (w_id,)
            if not trainable:
                continue
            dw_id = group_object("dW", layer.name, group.name)
            dw_layout = Layout.pack((p.name, p.shape, _dtype(p, policy.grad)) for p in trainable)
            add_packed(PackedObject(dw_id, "dW", layer.name, dw_layout, group.name), Role.GRAD)
            states = [
                (f"{p.name}/{field}", p.shape, train.optimizer.state_dtypes[field])
                for field in optimizer.state_fields
                for p in trainable
            ]
            o_id = group_object("O", layer.name, group.name)
            add_packed(
                PackedObject(o_id, "O", layer.name, Layout.pack(states), group.name),
                Role.OPT_STATE,
            )
            grads[layer.name] += (dw_id,)
        param_bytes[layer.name] = sum(packed[w].layout.size_bytes for w in weights[layer.name])
        if layer.aux:
            _add_aux(family.name, layer, packed, add_packed)
    for local, target in head.tied.items():
        owner, _, name = target.partition(".")
        if owner not in by_name or name not in {p.name for p in by_name[owner].params}:
            raise FamilyContractError(
                f"family {family.name!r}: head ties {local!r} to {target!r}, which no layer "
                "declares"
            )
    tied_layers = sorted({target.partition(".")[0] for target in head.tied.values()})

    hidden = TensorMeta(policy.activation, family.hidden_shape(config, train.batch, train.seq_len))
    tokens_meta = TensorMeta("int64", (train.batch, train.seq_len))
    act_bytes = hidden.nbytes // max(1, math.prod(hidden.shape))
    kinds = {block.kind for block in blocks}
    saved_layout, temp_layout, block_cost = {}, {}, {}
    partial_layouts: dict[str, dict[str, tuple[Layout, Layout]]] = {}  # kind -> name -> kept, rest
    for kind in kinds:
        kind_math = family.math(kind)
        saved_specs = kind_math.saved(config, train.batch, train.seq_len)
        saved_layout[kind] = _pack(saved_specs, policy.activation)
        partial_layouts[kind] = {
            name: _split(saved_specs, p, policy.activation)
            for name, p in partial_saves(kind_math, config, saved_specs).items()
        }
        temp_specs = kind_math.aux_temp(config, train.batch, train.seq_len)
        temp_layout[kind] = (
            Layout.pack((s.name, s.shape, _dtype(s, policy.activation)) for s in temp_specs)
            if temp_specs
            else None
        )
        block_cost[kind] = kind_math.cost(config, train.batch, train.seq_len, act_bytes)
        missing = set(partial_layouts[kind]) - set(block_cost[kind].partial)
        if missing:
            raise FamilyContractError(
                f"family {family.name!r}: block kind {kind!r} declares partial save(s) "
                f"{sorted(missing)} but its cost gives no LayerCost.partial work for them"
            )
    for (r, i), name in sorted(partial_of.items()):
        offered = partial_layouts[blocks[i].kind]
        if name not in offered:
            raise ValueError(
                f"partial names {name!r} for block {i} of round {r}; its kind "
                f"{blocks[i].kind!r} offers {', '.join(sorted(offered)) or 'no partial saves'}"
            )
    embed_cost = family.math("embed").cost(config, train.batch, train.seq_len, act_bytes)
    head_cost = family.math("head").cost(config, train.batch, train.seq_len, act_bytes)
    if train.head_vocab_tiles:  # the logits made again, tile by tile, over every token
        vocab, dim = embed.params[0].shape[:2]
        tokens = train.batch * train.seq_len
        was = head_cost.forward
        again = Work(
            was.flops + 2 * tokens * vocab * dim,
            was.bytes + 2 * tokens * vocab * act_bytes,  # the tiles' logits, written and read
            # a tile's logits matmul, its kernel and its d_weight matmul; about one tile
            # per token chunk
            was.kernels and was.kernels + 3 * math.ceil(tokens / train.chunk_tokens),
        )
        head_cost = attrs.evolve(head_cost, forward=again)

    def priced(work: Work, weight_bytes: float) -> float:
        return cost.cost_us(work.flops, work.bytes + weight_bytes, max(1, work.kernels))

    tasks: list[Task] = []
    slots: dict[str, TaskSlot] = {}

    def task(kind: str, r: int, layer: str, key: str, cost_us: float, **roles: Any) -> None:
        group = roles.pop("group", "")
        save = roles.pop("save", True)
        zero_aux = roles.pop("zero_aux", False)
        partial_name = roles.pop("partial", None)
        slot = TaskSlot(
            f"{kind}_{step}_{r}_{group_name(layer, group)}",
            kind,
            layer,
            r,
            key,
            roles.get("inputs", {}),
            roles.get("mutates", {}),
            roles.get("outputs", {}),
            group,
            save,
        )
        params: dict[str, Any] = {"family": family.name, "step": step, "round": r, "layer": layer}
        if kind in ("fwd", "rec", "bwd"):
            params["kind"] = by_name[layer].kind
        if kind == "fwd":
            params["save"] = save
            if zero_aux:
                params["zero_aux"] = True
        if partial_name is not None:
            params["partial"] = partial_name  # the partial save a rec task completes
        if group:
            params["group"] = group
        if kind == "head":
            params["chunk_tokens"] = train.chunk_tokens
            if train.head_vocab_tiles:
                params["vocab_tiles"] = True
        slots[slot.id] = slot
        tasks.append(
            Task(
                slot.id,
                kind,
                key,
                params=params,
                inputs=_flat(slot.inputs),
                mutates=_flat(slot.mutates),
                outputs=_flat(slot.outputs),
                cost_us=cost_us,
            )
        )

    def grad_roles(layer: str, r: int, *, created: bool | None = None) -> dict[str, Any]:
        """Round 0 creates a layer's gradients, later rounds accumulate into them."""
        create = r == 0 if created is None else created
        return {"outputs" if create else "mutates": {"grad": grads[layer]}}

    n_blocks = len(blocks)
    zeroed: set[str] = set()  # Aux objects the step's forwards have zeroed
    for r in range(train.rounds):
        x, t, loss = f"x_{step}_{r}", f"t_{step}_{r}", f"loss_{step}_{r}"
        objects += [
            Obj(x, tokens_meta.nbytes, Role.DATA, "slow", tokens_meta),
            Obj(t, tokens_meta.nbytes, Role.DATA, "slow", tokens_meta),
            Obj(loss, 4, Role.OUTPUT, tensor=TensorMeta("float32", ())),
        ]
        y = [f"y_{step}_{r}_{i}" for i in range(n_blocks + 1)]
        dy = [f"dy_{step}_{r}_{i}" for i in range(n_blocks + 1)]
        objects += [Obj(name, hidden.nbytes, Role.ACTIVATION, tensor=hidden) for name in y]
        objects += [Obj(name, hidden.nbytes, Role.GRAD, tensor=hidden) for name in dy]
        saved, rest, temps = {}, {}, {}
        for i, block in enumerate(blocks):
            saved[i] = f"A_{step}_{r}_{i}"
            layout = saved_layout[block.kind]
            parts = [(saved[i], saved_layout[block.kind])]
            if (r, i) in partial_of:  # what forward keeps, and what its rec task makes
                name = partial_of[r, i]
                rest[i] = f"{saved[i]}.{name}"
                parts = list(
                    zip((saved[i], rest[i]), partial_layouts[block.kind][name], strict=True)
                )
            for obj_id, layout in parts:
                packed[obj_id] = PackedObject(obj_id, "A", block.name, layout)
                objects.append(Obj(obj_id, layout.size_bytes, Role.ACTIVATION))
            if temp_layout[block.kind] is not None:
                temps[i] = f"AuxTemp_{step}_{r}_{i}"
                layout = temp_layout[block.kind]
                packed[temps[i]] = PackedObject(temps[i], "AuxTemp", block.name, layout)
                objects.append(Obj(temps[i], layout.size_bytes, Role.AUX_TEMP))

        task(
            "embed",
            r,
            embed.name,
            family_key(family.name, "embed", "forward"),
            priced(embed_cost.forward, 0),
            inputs={"tokens": (x,), "w": weights[embed.name]},
            outputs={"y": (y[0],)},
        )
        for i, block in enumerate(blocks):
            keep = (r, i) not in recompute
            temp = (temps[i],) if i in temps else ()
            aux = (block.aux_object,) if block.aux else ()
            if aux and aux[0] not in zeroed:  # the step's first forward to touch it
                zeroed.add(aux[0])
                zero_aux = True
            else:
                zero_aux = False
            task(
                "fwd",
                r,
                block.name,
                family_key(family.name, block.kind, "forward"),
                priced(block_cost[block.kind].forward, param_bytes[block.name]),
                inputs={"x": (y[i],), "w": weights[block.name]},
                mutates={"aux": aux},
                outputs={"y": (y[i + 1],), "saved": (saved[i],) if keep else (), "aux_temp": temp},
                save=keep,
                zero_aux=zero_aux,
            )
        head_grad = grad_roles(head.name, r)
        tied_w = tuple(w for layer in tied_layers for w in weights[layer])
        tied_grad = tuple(g for layer in tied_layers for g in grads[layer])
        head_mut = dict(head_grad.get("mutates", {}))
        head_out = {"loss": (loss,), "dx": (dy[n_blocks],), **head_grad.get("outputs", {})}
        if tied_grad:
            (head_out if r == 0 else head_mut)["tied_grad"] = tied_grad
        task(
            "head",
            r,
            head.name,
            family_key(family.name, "head", "loss"),
            priced(
                head_cost.forward,
                param_bytes[head.name] + 2 * sum(packed[w].layout.size_bytes for w in tied_w),
            ),
            inputs={"x": (y[n_blocks],), "targets": (t,), "w": weights[head.name], "tied": tied_w},
            mutates=head_mut,
            outputs=head_out,
        )
        for i in reversed(range(n_blocks)):
            block = blocks[i]
            temp = (temps[i],) if i in temps else ()
            if (r, i) in recompute:
                work = block_cost[block.kind].recompute or block_cost[block.kind].forward
                task(
                    "rec",
                    r,
                    block.name,
                    family_key(family.name, block.kind, "recompute"),
                    priced(work, param_bytes[block.name]),
                    inputs={"x": (y[i],), "w": weights[block.name], "aux_temp": temp},
                    outputs={"saved": (saved[i],)},
                )
            elif (r, i) in partial_of:
                task(
                    "rec",
                    r,
                    block.name,
                    family_key(family.name, block.kind, "recompute"),
                    priced(
                        block_cost[block.kind].partial[partial_of[r, i]], param_bytes[block.name]
                    ),
                    inputs={
                        "x": (y[i],),
                        "w": weights[block.name],
                        "saved": (saved[i],),
                        "aux_temp": temp,
                    },
                    outputs={"saved": (rest[i],)},
                    partial=partial_of[r, i],
                )
            aux = (block.aux_object,) if block.aux and r == train.rounds - 1 else ()
            roles = grad_roles(block.name, r)
            task(
                "bwd",
                r,
                block.name,
                family_key(family.name, block.kind, "backward"),
                priced(block_cost[block.kind].backward, 2 * param_bytes[block.name]),
                inputs={
                    "dy": (dy[i + 1],),
                    "x": (y[i],),
                    "saved": (saved[i], *((rest[i],) if i in rest else ())),
                    "aux_temp": temp,
                    "aux": aux,
                    "w": weights[block.name],
                },
                outputs={"dx": (dy[i],), **roles.get("outputs", {})},
                mutates=roles.get("mutates", {}),
            )
        # a tied head ran first and already created the embedding's gradient
        created = r == 0 and embed.name not in tied_layers
        roles = grad_roles(embed.name, r, created=created)
        task(
            "embbwd",
            r,
            embed.name,
            family_key(family.name, "embed", "backward"),
            priced(embed_cost.backward, param_bytes[embed.name]),
            inputs={"dy": (dy[0],), "tokens": (x,)},
            outputs=roles.get("outputs", {}),
            mutates=roles.get("mutates", {}),
        )

    if train.order != "round":
        tasks[:] = _layer_major(tasks, [layer.name for layer in layers], train.order_group)
    last = train.rounds - 1
    if grad_share is not None:
        _allreduce_tasks(
            grad_share, train.rounds - 1, grads, packed, tasks=tasks, task=task, cost=cost
        )
    norms = _grad_norm_tasks(train, tasks, task, grads, packed, cost, step, objects)
    key = optimizer_key(train.optimizer.name)
    for layer in (head, *reversed(blocks), embed):
        for group in layer.groups:
            dw_id = group_object("dW", layer.name, group.name)
            if dw_id not in packed:
                continue  # nothing trainable in this group
            w_id, o_id = (
                group_object("W", layer.name, group.name),
                group_object("O", layer.name, group.name),
            )
            moved = (
                2 * packed[w_id].layout.size_bytes
                + packed[dw_id].layout.size_bytes
                + 2 * packed[o_id].layout.size_bytes
            )
            clipped = train.clip is not None  # the update scales dW in place
            task(
                "opt",
                last,
                layer.name,
                key,
                cost.cost_us(0, moved),
                inputs={"grad": () if clipped else (dw_id,), "grad_norm": norms if clipped else ()},
                mutates={
                    "w": (w_id,),
                    "opt_state": (o_id,),
                    "grad": (dw_id,) if clipped else (),
                },
                group=group.name,
            )
    if train.early_updates and grad_share is None:
        tasks[:] = _updates_after_last_use(tasks)
    finals = {p.id: "slow" for p in packed.values() if p.kind in ("W", "O", "Aux")}
    finals |= {f"loss_{step}_{r}": "slow" for r in range(train.rounds)}
    finals |= {gn: "slow" for gn in norms}
    if keep_grads:
        finals |= {p.id: "slow" for p in packed.values() if p.kind == "dW"}
    if keep_aux_temp:
        finals |= {p.id: "slow" for p in packed.values() if p.kind == "AuxTemp"}
    step_layout = StepLayout(
        family=family.name,
        preset=preset,
        overrides=overrides,
        train=train,
        step=step,
        layers=tuple(
            LayerInfo(layer.name, layer.kind, tuple(g.name for g in layer.groups), layer.tied)
            for layer in layers
        ),
        tasks=slots,
        packed=packed,
    )
    program = Program(
        name=f"{family.name}-{preset}-train",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations=finals,
        persistent=tuple(p.id for p in packed.values() if p.kind in ("W", "O", "Aux")),
        links=_step_links(links, grad_share),
        metadata=step_layout.to_metadata(),
    )
    return Lowered(program, step_layout, layers)


def _add_aux(family: str, layer: LayerSpec, packed: dict[str, PackedObject], add: Any) -> None:
    """The Aux object of ``layer``: its own, or (``aux_scope="model"``) the one its kind
    shares, added by the first layer of the kind; the others must declare the same
    tensors."""
    obj = layer.aux_object
    aux_layout = Layout.pack((a.name, a.shape, _dtype(a, "float32")) for a in layer.aux)
    if obj not in packed:
        add(PackedObject(obj, "Aux", layer.name, aux_layout), Role.AUX)
    elif packed[obj].kind != "Aux" or layer.aux_scope != "model":
        raise FamilyContractError(f"family {family!r}: layer {layer.name!r}: {obj} already exists")
    elif packed[obj].layout != aux_layout:
        raise FamilyContractError(
            f"family {family!r}: layer {layer.name!r} declares aux tensors "
            f"{[(a.name, a.shape) for a in layer.aux]} but {obj}, shared by the {layer.kind!r} "
            f"layers, was declared by layer {packed[obj].layer!r} with others"
        )


def _pack(specs: Iterable[TensorSpec], policy_dtype: str) -> Layout:
    return Layout.pack((s.name, s.shape, _dtype(s, policy_dtype)) for s in specs)


def _split(
    saved: tuple[TensorSpec, ...], partial: PartialSave, policy_dtype: str
) -> tuple[Layout, Layout]:
    """The layouts of what a partial save keeps and of what its ``rec`` task re-derives,
    each in ``saved``'s order."""
    kept = [s for s in saved if s.name in partial.keeps]
    return _pack(kept, policy_dtype), _pack(
        (s for s in saved if s.name not in partial.keeps), policy_dtype
    )


def _partial_units(
    partial: Mapping[int | tuple[int, int], str],
    rounds: int,
    n_blocks: int,
    recompute: frozenset[tuple[int, int]],
) -> dict[tuple[int, int], str]:
    """``lower``'s ``partial`` by ``(round, block)``; a unit named twice with different
    partial saves, or also in ``recompute``, is an error naming it."""
    units: dict[tuple[int, int], str] = {}
    for item, name in partial.items():
        for unit in sorted(recompute_units([item], rounds, n_blocks)):
            if units.get(unit, name) != name or unit in recompute:
                how = "in recompute too" if unit in recompute else f"as {units[unit]!r} too"
                raise ValueError(f"partial names block {unit[1]} of round {unit[0]} {how}")
            units[unit] = name
    return units


def _step_links(links: Links | None, grad_share: float | None) -> Links:
    links = links or Links()
    if grad_share is None or links.collective is not None:
        return links
    return attrs.evolve(links, collective=ASSUMED_COLLECTIVE)


def recompute_units(
    recompute: Iterable[int | tuple[int, int]], rounds: int, n_blocks: int
) -> frozenset[tuple[int, int]]:
    """``lower``'s ``recompute`` as ``(round, block)`` pairs; a bare block index stands
    for that block in every round."""
    units = set()
    for item in recompute:
        pairs = [(r, item) for r in range(rounds)] if isinstance(item, int) else [tuple(item)]
        for r, i in pairs:
            if not (0 <= i < n_blocks and 0 <= r < rounds):
                raise ValueError(
                    f"recompute names block {i} of round {r}; the model has {n_blocks} "
                    f"block(s) and the step {rounds} round(s)"
                )
            units.add((r, i))
    return frozenset(units)


def _grad_norm_tasks(
    train: TrainConfig,
    tasks: list[Task],
    task: Any,
    grads: dict[str, tuple[str, ...]],
    packed: dict[str, PackedObject],
    cost: RooflineCost,
    step: int,
    objects: list[Obj],
) -> tuple[str, ...]:
    """With ``train.measures_grad_norm``: one ``gnorm`` task per trainable group, placed
    right after the task that completes the group's last-round gradient, writing the
    group's squared norm ``gn_<step>_<layer>[.<group>]`` (float32). Returns the ``gn`` ids
    in layer order (every optimizer task sums them in that order), empty when the step
    measures no norm."""
    if not train.measures_grad_norm:
        return ()
    norms = []

    def make(layer: str, dw: str) -> None:
        group = packed[dw].group
        gn = group_object(f"gn_{step}", layer, group)
        objects.append(Obj(gn, 4, Role.OUTPUT, tensor=TensorMeta("float32", ())))
        task(
            "gnorm",
            train.rounds - 1,
            layer,
            GRAD_NORM_KEY,
            cost.cost_us(2 * packed[dw].layout.size_bytes // 4, packed[dw].layout.size_bytes),
            inputs={"grad": (dw,)},
            outputs={"grad_norm": (gn,)},
            group=group,
        )
        norms.append(gn)

    _after_last_grad(tasks, task, grads, make)
    return tuple(norms)


def _after_last_grad(
    tasks: list[Task], task: Any, grads: dict[str, tuple[str, ...]], make: Any
) -> None:
    """For every trainable group's ``dW``, ``make(layer, dw)`` adds one task (through
    ``task``), which is moved to right after the task that completes ``dW``."""
    after: dict[int, list[Task]] = {}
    for layer, dws in grads.items():
        for dw in dws:
            done = max(i for i, t in enumerate(tasks) if dw in t.outputs or dw in t.mutates)
            make(layer, dw)
            after.setdefault(done, []).append(tasks.pop())
    chain = list(tasks)
    tasks.clear()
    for i, t in enumerate(chain):
        tasks += [t, *after.get(i, ())]


def _updates_after_last_use(tasks: list[Task]) -> list[Task]:
    """The chain with each optimizer task moved to right after the last other task that
    touches its group's weights or gradient (the last round's backward of its layer; for
    weights two layers share, the later one's), the updates of one place in their order.

    The update then finds the group's weights and gradient still in fast memory and frees
    them (and its optimizer state) while the layers below run backward, where at the end
    of the step every group's weights, gradient and state come back over the link with no
    compute left to hide behind (session 19, OLMoE 1B-7B at 16 GiB by layer: 0.76 s of
    its 6.29 s simulated step was compute waiting for the experts' 3.2 GB a layer). Not
    with a clip (every update reads every group's norm) nor an all-reduce (the update
    would wait on the collective); ``TrainConfig.updates`` says when."""
    updates = [t for t in tasks if t.kind == "opt"]
    chain = [t for t in tasks if t.kind != "opt"]
    after: dict[int, list[Task]] = {}
    for update in updates:
        own = set(update.mutates) | set(update.inputs)
        last = max(i for i, t in enumerate(chain) if own & {*t.inputs, *t.mutates, *t.outputs})
        after.setdefault(last, []).append(update)
    return [u for i, t in enumerate(chain) for u in (t, *after.get(i, ()))]


def _allreduce_tasks(
    share: float, last_round: int, grads: dict[str, tuple[str, ...]], packed: Any, **chain: Any
) -> None:
    """One ``allreduce`` task per trainable group (``lower``'s ``grad_share``), mutating
    the group's ``dW``, on the collective link (no compute cost: the link prices it by
    the gradient's size); its ``share`` is in the task's params."""

    def make(layer: str, dw: str) -> None:
        chain["task"](
            "allreduce",
            last_round,
            layer,
            GRAD_ALLREDUCE_KEY,
            0.0,
            mutates={"grad": (dw,)},
            group=packed[dw].group,
        )
        tasks = chain["tasks"]
        tasks[-1] = attrs.evolve(
            tasks[-1],
            params={**tasks[-1].params, "share": share},
            resource=Resource.COLLECTIVE,
        )

    _after_last_grad(chain["tasks"], chain["task"], grads, make)


def _layer_major(tasks: list[Task], layer_names: list[str], group: int) -> list[Task]:
    """The round-major chain of the rounds' tasks, reordered layer by layer within each
    group of ``group`` consecutive rounds (the groups one after another): the group's
    forwards (embed, blocks, head) by layer position then round, then its backwards (a
    block's recompute right before its backward) by layer position descending then round.

    Every dependency still points backwards: a round's forward reads the layer below's
    output for that round, a backward the layer above's input gradient, and a gradient is
    created by round 0's task of its layer and accumulated by the later rounds' in order."""
    position = {name: i for i, name in enumerate(layer_names)}
    backward = {"rec": 0, "bwd": 1, "embbwd": 1}

    def key(t: Task) -> tuple[int, int, int, int, int]:
        place, r = position[t.params["layer"]], t.params["round"]
        if t.kind in ("embed", "fwd", "head"):
            return (r // group, 0, place, r, 0)
        return (r // group, 1, len(layer_names) - place, r, backward[t.kind])

    return sorted(tasks, key=key)


def _flat(roles: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A task's objects in the fixed role order (the order of ``step.ROLES``)."""
    return tuple(obj for role in ROLES for obj in roles.get(role, ()))
