"""The objects and tasks of one accumulation round of a lowered step (``lower_round``).

``lowering.lower`` builds the step's parameters (``Parameters``) and what each block kind
saves and costs (``Kinds``) once, then lowers every round through ``lower_round``: the
round's tokens, targets, loss, hidden states and their gradients, each block's saved
activations (whole, or the kept part and the re-derived rest of a partial save) and
AuxTemp, and its tasks: embed, the blocks' forwards, the head, then from the top each
block's backward (after its ``rec`` task where the unit is re-derived), the embedding's
backward. Round 0 creates the gradients, later rounds accumulate into them
(``grad_roles``). Frozen parameters (``step.freezing``) prune the backward: a block with
nothing trainable at or below it has no backward task and saves nothing for one, the
lowest block that has one makes no input gradient, and a frozen embedding has no
``embbwd``. With ``TrainConfig.segments`` each round has a segments object ``S_s_r`` (data,
like its tokens), an input of every task whose math reads ``Env.segments``: each block's
forward, full recompute and backward (a routed block's ``fwd`` and ``bwd``; not the
expert shards' tasks, nor a partial save's ``rec``, which re-derives the FFN only).
"""

from __future__ import annotations

from typing import Any

import attrs

from dataflow import Obj, Role, TensorMeta
from dataflow_training.step.family import LayerCost, LayerSpec, Work
from dataflow_training.step.freezing import trains
from dataflow_training.step.keys import family_key
from dataflow_training.step.layout import PackedObject
from dataflow_training.step.packing import Layout
from dataflow_training.step.step_chain import StepChain, group_object


@attrs.frozen
class Parameters:
    """Every layer's parameter objects, by layer name, and the layers the head ties to."""

    weights: dict[str, tuple[str, ...]]  # its W objects
    grads: dict[str, tuple[str, ...]]  # its dW objects (the trainable groups')
    param_bytes: dict[str, int]  # its W objects' bytes
    tied: tuple[str, ...]


@attrs.frozen
class Apart:
    """A block kind whose routed experts run apart, in ``shards`` shards: the layouts of
    what its routing task saves (``A``), of the experts' object (``A_<...>.experts``: their
    input and ``gate_up``) and of their gradient to the block (``dE``); the work of the
    routing tasks (``fwd`` and ``bwd``) and of one shard's (``efwd`` and ``ebwd``; its
    ``recompute``: what ``ebwd`` adds making its rows' ``gate_up`` again). ``inputs``:
    the experts' object of a re-derived block (their input alone; the shards' backward
    make ``gate_up`` again)."""

    shards: int
    saved: Layout
    experts: Layout
    grad: Layout
    route: LayerCost
    shard: LayerCost
    inputs: Layout


@attrs.frozen
class Kinds:
    """What each block kind saves for its backward and costs, at the step's shape; and
    the embed's and the head's costs; the kinds whose experts run apart."""

    saved: dict[str, Layout]
    #: kind -> partial save -> (what forward keeps, what its rec task re-derives)
    partial: dict[str, dict[str, tuple[Layout, Layout]]]
    temp: dict[str, Layout | None]
    cost: dict[str, LayerCost]
    embed: LayerCost
    head: LayerCost
    apart: dict[str, Apart] = attrs.field(factory=dict)
    #: kind -> the layout of the KL target of a group its layers lead (``LayerSpec.leader``)
    shared: dict[str, Layout] = attrs.field(factory=dict)


@attrs.frozen
class Rounds:
    """What lowering each round reads: the layers, their objects and costs, the units
    re-derived whole (``recompute``) or in part (``partial``: name by unit), the shapes;
    ``segments`` the shape of a round's segments object, None in a step without them."""

    embed: LayerSpec
    blocks: tuple[LayerSpec, ...]
    head: LayerSpec
    params: Parameters
    kinds: Kinds
    recompute: frozenset[tuple[int, int]]
    partial: dict[tuple[int, int], str]
    hidden: TensorMeta
    tokens: TensorMeta
    segments: TensorMeta | None = None


def grad_roles(grads: tuple[str, ...], r: int, created: bool | None = None) -> dict[str, Any]:
    """Round 0 creates a layer's gradients, later rounds accumulate into them."""
    create = r == 0 if created is None else created
    return {"outputs" if create else "mutates": {"grad": grads}}


def backward_blocks(embed: LayerSpec, blocks: tuple[LayerSpec, ...]) -> list[bool]:
    """For each block, whether it has a backward task: whether something at or below it
    trains (a frozen bottom of the model needs no gradient past its top trainable layer)."""
    out, below = [], trains(embed)
    for block in blocks:
        below = below or trains(block)
        out.append(below)
    return out


def leaders(blocks: tuple[LayerSpec, ...]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(follower -> its leader, leader -> its followers in order) by block index, of the
    blocks whose ``LayerSpec.leader`` names another (``lowering`` checked the names)."""
    index = {block.name: i for i, block in enumerate(blocks)}
    leads = {i: index[b.leader] for i, b in enumerate(blocks) if b.leader}
    groups: dict[int, list[int]] = {}
    for follower, leader in leads.items():
        groups.setdefault(leader, []).append(follower)
    return leads, groups


def _aux_temp(chain: StepChain, s: Rounds, r: int, i: int, block: LayerSpec, temps: dict) -> None:
    """Block ``i``'s AuxTemp object of round ``r``, where its kind has one."""
    layout = s.kinds.temp[block.kind]
    if layout is None:
        return
    temps[i] = f"AuxTemp_{chain.step}_{r}_{i}"
    chain.packed[temps[i]] = PackedObject(temps[i], "AuxTemp", block.name, layout)
    chain.objects.append(Obj(temps[i], layout.size_bytes, Role.AUX_TEMP))


def lower_round(chain: StepChain, s: Rounds, r: int, zeroed: set[str]) -> None:
    """Round ``r``'s objects (tokens, targets, loss, hidden states and their gradients,
    each block's saved activations and AuxTemp) and tasks: embed, the blocks' forwards,
    the head, then each block's backward from the top (after its ``rec`` task where the
    unit is re-derived), the embedding's backward. ``zeroed``: the Aux objects the
    step's forwards have zeroed so far (the first forward to touch one zeroes it)."""
    family, step = chain.family, chain.step
    weights, grads, param_bytes = s.params.weights, s.params.grads, s.params.param_bytes
    embed, head, blocks = s.embed, s.head, s.blocks
    hidden, tokens_meta = s.hidden, s.tokens
    x, t, loss = f"x_{step}_{r}", f"t_{step}_{r}", f"loss_{step}_{r}"
    chain.objects += [
        Obj(x, tokens_meta.nbytes, Role.DATA, "slow", tokens_meta),
        Obj(t, tokens_meta.nbytes, Role.DATA, "slow", tokens_meta),
        Obj(loss, 4, Role.OUTPUT, tensor=TensorMeta("float32", ())),
    ]
    # the round's segments, read by the block tasks whose attention takes them
    seg: tuple[str, ...] = ()
    if s.segments is not None:
        seg = (f"S_{step}_{r}",)
        chain.objects.append(Obj(seg[0], s.segments.nbytes, Role.DATA, "slow", s.segments))
    n_blocks = len(blocks)
    backward = backward_blocks(embed, blocks)
    y = [f"y_{step}_{r}_{i}" for i in range(n_blocks + 1)]
    # dy_i, the gradient of y_i: made where something at or below layer i trains
    dy = [f"dy_{step}_{r}_{i}" for i in range(n_blocks + 1)]
    wanted_dy = [trains(embed), *backward]
    chain.objects += [Obj(name, hidden.nbytes, Role.ACTIVATION, tensor=hidden) for name in y]
    chain.objects += [
        Obj(name, hidden.nbytes, Role.GRAD, tensor=hidden)
        for name, wanted in zip(dy, wanted_dy, strict=True)
        if wanted
    ]
    saved, rest, temps = {}, {}, {}
    leads, groups = leaders(blocks)

    def shared(i: int) -> tuple[str, ...]:
        """The leader's AuxTemp a follower's tasks read."""
        return (temps[leads[i]],) if i in leads else ()

    def bwd_shared(i: int) -> dict[str, tuple[str, ...]]:
        """Block ``i``'s backward's ``shared`` objects by part: a group's KL target is
        made by its last member's backward, changed by the middle ones' and read by the
        leader's; a follower reads its leader's AuxTemp too."""
        roles = {"inputs": shared(i), "outputs": (), "mutates": ()}
        if i in leads:
            target = (f"Target_{step}_{r}_{leads[i]}",)
            roles["outputs" if groups[leads[i]][-1] == i else "mutates"] = target
        elif i in groups:
            roles["inputs"] = (f"Target_{step}_{r}_{i}",)
        return roles

    # the objects of the blocks whose experts run apart: the experts' object forward
    # writes, the one backward reads (the same but where the block is re-derived), dE
    experts, experts_back, d_experts = {}, {}, {}
    for i, block in enumerate(blocks):
        if i in groups and backward[i]:  # the group's KL target, its backwards' object
            target = f"Target_{step}_{r}_{i}"
            layout = s.kinds.shared[block.kind]
            chain.packed[target] = PackedObject(target, "Target", block.name, layout)
            chain.objects.append(Obj(target, layout.size_bytes, Role.AUX_TEMP))
        apart = s.kinds.apart.get(block.kind)
        if apart is not None:
            made = _apart_objects(chain, s, r, i, block, apart, backward[i], saved, temps)
            (experts[i], experts_back[i]), d_experts[i] = made, f"dE_{step}_{r}_{i}"
            continue
        if i in groups or backward[i]:  # a leader's selection: its followers read it
            _aux_temp(chain, s, r, i, block, temps)
        if not backward[i]:
            continue  # nothing at or below it trains: no backward, nothing saved for one
        saved[i] = f"A_{step}_{r}_{i}"
        parts = [(saved[i], s.kinds.saved[block.kind])]
        if (r, i) in s.partial:  # what forward keeps, and what its rec task makes
            name = s.partial[r, i]
            rest[i] = f"{saved[i]}.{name}"
            parts = list(zip((saved[i], rest[i]), s.kinds.partial[block.kind][name], strict=True))
        for obj_id, layout in parts:
            chain.packed[obj_id] = PackedObject(obj_id, "A", block.name, layout)
            chain.objects.append(Obj(obj_id, layout.size_bytes, Role.ACTIVATION))

    chain.task(
        "embed",
        r,
        embed.name,
        family_key(family, "embed", "forward"),
        chain.priced(s.kinds.embed.forward, 0),
        inputs={"tokens": (x,), "w": weights[embed.name]},
        outputs={"y": (y[0],)},
    )
    for i, block in enumerate(blocks):
        keep = (r, i) not in s.recompute and backward[i]
        temp = (temps[i],) if i in temps else ()
        aux = (block.aux_object,) if block.aux else ()
        zero_aux = bool(aux) and aux[0] not in zeroed  # the step's first forward to touch it
        if zero_aux:
            zeroed.add(aux[0])
        if i in experts:
            kept = {} if (r, i) in s.recompute else saved  # re-derived: its A not saved
            apart_forward(
                chain, s.kinds.apart[block.kind], r, i, block, (y[i], y[i + 1]), kept, temps,
                experts, zero_aux, shared(i), seg,
            )  # fmt: skip
            continue
        chain.task(
            "fwd",
            r,
            block.name,
            family_key(family, block.kind, "forward"),
            chain.priced(s.kinds.cost[block.kind].forward, param_bytes[block.name]),
            inputs={"x": (y[i],), "w": weights[block.name], "shared": shared(i), "segments": seg},
            mutates={"aux": aux},
            outputs={"y": (y[i + 1],), "saved": (saved[i],) if keep else (), "aux_temp": temp},
            save=keep,
            zero_aux=zero_aux,
        )
    head_grad = grad_roles(grads[head.name], r)
    tied_w = tuple(w for layer in s.params.tied for w in weights[layer])
    tied_grad = tuple(g for layer in s.params.tied for g in grads[layer])
    head_mut = dict(head_grad.get("mutates", {}))
    head_dx = (dy[n_blocks],) if wanted_dy[n_blocks] else ()
    head_out = {"loss": (loss,), "dx": head_dx, **head_grad.get("outputs", {})}
    if tied_grad:
        (head_out if r == 0 else head_mut)["tied_grad"] = tied_grad
    chain.task(
        "head",
        r,
        head.name,
        family_key(family, "head", "loss"),
        chain.priced(
            s.kinds.head.forward,
            param_bytes[head.name] + 2 * sum(chain.packed[w].layout.size_bytes for w in tied_w),
        ),
        inputs={"x": (y[n_blocks],), "targets": (t,), "w": weights[head.name], "tied": tied_w},
        mutates=head_mut,
        outputs=head_out,
    )
    for i in reversed(range(n_blocks)):
        if not backward[i]:
            break  # nor below it
        block = blocks[i]
        block_cost = s.kinds.cost[block.kind]
        temp = (temps[i],) if i in temps else ()
        if i in experts:
            dys = (dy[i + 1], dy[i] if wanted_dy[i] else None)
            _apart_backward(
                chain, s, r, i, block, (y[i], dys), saved, temps, experts_back, d_experts,
                bwd_shared(i), seg, shared(i),
            )  # fmt: skip
            continue
        if (r, i) in s.recompute:
            chain.task(
                "rec",
                r,
                block.name,
                family_key(family, block.kind, "recompute"),
                chain.priced(block_cost.recompute or block_cost.forward, param_bytes[block.name]),
                inputs={
                    "x": (y[i],),
                    "w": weights[block.name],
                    "aux_temp": temp,
                    "shared": shared(i),
                    "segments": seg,
                },
                outputs={"saved": (saved[i],)},
            )
        elif (r, i) in s.partial:
            chain.task(
                "rec",
                r,
                block.name,
                family_key(family, block.kind, "recompute"),
                chain.priced(block_cost.partial[s.partial[r, i]], param_bytes[block.name]),
                inputs={
                    "x": (y[i],),
                    "w": weights[block.name],
                    "saved": (saved[i],),
                    "aux_temp": temp,
                    "shared": shared(i),
                },
                outputs={"saved": (rest[i],)},
                partial=s.partial[r, i],
            )
        aux = (block.aux_object,) if block.aux and r == chain.train.rounds - 1 else ()
        roles = grad_roles(grads[block.name], r)
        group = bwd_shared(i)
        chain.task(
            "bwd",
            r,
            block.name,
            family_key(family, block.kind, "backward"),
            chain.priced(block_cost.backward, 2 * param_bytes[block.name]),
            inputs={
                "dy": (dy[i + 1],),
                "x": (y[i],),
                "saved": (saved[i], *((rest[i],) if i in rest else ())),
                "aux_temp": temp,
                "aux": aux,
                "w": weights[block.name],
                "shared": group["inputs"],
                "segments": seg,
            },
            outputs={
                "dx": (dy[i],) if wanted_dy[i] else (),
                "shared": group["outputs"],
                **roles.get("outputs", {}),
            },
            mutates={"shared": group["mutates"], **roles.get("mutates", {})},
        )
    if not wanted_dy[0]:
        return  # the embedding does not train
    # a tied head ran first and already created the embedding's gradient
    created = r == 0 and embed.name not in s.params.tied
    roles = grad_roles(grads[embed.name], r, created=created)
    chain.task(
        "embbwd",
        r,
        embed.name,
        family_key(family, "embed", "backward"),
        chain.priced(s.kinds.embed.backward, param_bytes[embed.name]),
        inputs={"dy": (dy[0],), "tokens": (x,)},
        outputs=roles.get("outputs", {}),
        mutates=roles.get("mutates", {}),
    )


# -- blocks whose experts run apart (``Apart``) --------------------------------------------


def _groups_apart(chain: StepChain, block: LayerSpec) -> tuple[tuple[str, ...], list[Any]]:
    """(the block's ``W`` objects but its expert shards', its shard groups in order)."""
    main = tuple(group_object("W", block.name, g.name) for g in block.groups if g.shard is None)
    return main, sorted((g for g in block.groups if g.shard is not None), key=lambda g: g.shard)


def _bytes(chain: StepChain, ids: Any) -> int:
    return sum(chain.packed[w].layout.size_bytes for w in ids)


def _apart_objects(
    chain: StepChain,
    s: Rounds,
    r: int,
    i: int,
    block: LayerSpec,
    apart: Apart,
    backward: bool,
    saved: dict[int, str],
    temps: dict[int, str],
) -> tuple[str, str]:
    """Round ``r``'s objects of block ``i``: its AuxTemp, the experts' object (their input
    and ``gate_up``), and where it has a backward its ``A`` and the experts' gradient to
    it ``dE``. A re-derived block (``s.recompute``) has two experts' objects of their
    input alone: forward's, ``A_<...>.moe_in``, read by the shards' forward, and the one
    its ``rec`` task makes for the shards' backward; a block with no backward has one, of
    their input alone. -> (forward's experts' object, backward's)."""
    step = chain.step
    base = f"A_{step}_{r}_{i}"
    experts = f"{base}.experts"
    made = [(f"AuxTemp_{step}_{r}_{i}", "AuxTemp", s.kinds.temp[block.kind], Role.AUX_TEMP)]
    if backward and (r, i) not in s.recompute:
        forward = experts
        made.append((experts, "A", apart.experts, Role.ACTIVATION))
    else:
        forward = f"{base}.moe_in" if backward else experts
        made += [(o, "A", apart.inputs, Role.ACTIVATION) for o in dict.fromkeys((forward, experts))]
    if backward:
        made.append((base, "A", apart.saved, Role.ACTIVATION))
        made.append((f"dE_{step}_{r}_{i}", "dE", apart.grad, Role.GRAD))
        saved[i] = base
    temps[i] = made[0][0]
    for obj_id, kind, layout, role in made:
        chain.packed[obj_id] = PackedObject(obj_id, kind, block.name, layout)
        chain.objects.append(Obj(obj_id, layout.size_bytes, role))
    return forward, experts


def apart_forward(
    chain: StepChain,
    apart: Apart,
    r: int,
    i: int,
    block: LayerSpec,
    x_y: tuple[str, str],
    saved: dict[int, str],
    temps: dict[int, str],
    experts: dict[int, str],
    zero_aux: bool,
    shared: tuple[str, ...],
    seg: tuple[str, ...] = (),
) -> None:
    """The routing task ``fwd`` (the attention half, the router, the shared expert: it
    makes the block's output, ``A``, AuxTemp and the experts' input; it reads the
    round's segments ``seg`` where the step has them), then one ``efwd`` per shard adding
    its experts' rows into the output and writing their ``gate_up`` where the experts'
    object ``experts[i]`` has room for it (where it holds their input alone, the block is
    re-derived or has no backward, the shards only read it). Also the forward-only
    step's (``step.forward_only``: no ``saved`` entry, so no ``A``)."""
    family = chain.family
    (x, y), main = x_y, _groups_apart(chain, block)[0]
    aux = (block.aux_object,) if block.aux else ()
    chain.task(
        "fwd",
        r,
        block.name,
        family_key(family, block.kind, "route_forward"),
        chain.priced(apart.route.forward, _bytes(chain, main)),
        inputs={"x": (x,), "w": main, "shared": shared, "segments": seg},
        mutates={"aux": aux},
        outputs={
            "y": (y,),
            "saved": (*((saved[i],) if i in saved else ()), experts[i]),
            "aux_temp": (temps[i],),
        },
        zero_aux=zero_aux,
    )
    writes = chain.packed[experts[i]].layout != apart.inputs  # the shards' gate_up rows
    for group in _groups_apart(chain, block)[1]:
        w = group_object("W", block.name, group.name)
        objects = {"saved": (experts[i],)}
        chain.task(
            "efwd",
            r,
            block.name,
            family_key(family, block.kind, "experts_forward"),
            chain.priced(apart.shard.forward, _bytes(chain, (w,))),
            inputs={"w": (w,), "aux_temp": (temps[i],), **({} if writes else objects)},
            mutates={"y": (y,), **(objects if writes else {})},
            group=group.name,
            shard=group.shard,
        )


def _apart_backward(
    chain: StepChain,
    s: Rounds,
    r: int,
    i: int,
    block: LayerSpec,
    x_dys: tuple[str, tuple[str, str | None]],
    saved: dict[int, str],
    temps: dict[int, str],
    experts: dict[int, str],
    d_experts: dict[int, str],
    shared: dict[str, tuple[str, ...]],
    seg: tuple[str, ...] = (),
    fwd_shared: tuple[str, ...] = (),
) -> None:
    """One ``ebwd`` per shard (its experts' gradient; the first creates ``dE``, the others
    add to it), then the routing task ``bwd`` (the router, the shared expert, the
    attention half: ``dx`` and the main group's gradient). Where the unit is re-derived
    (``s.recompute``) a ``rec`` task comes first: it makes ``A`` and the experts' input
    ``experts[i]`` again by forward's routing (``fwd_shared``: the objects of other
    layers forward read), and each ``ebwd`` makes its rows' ``gate_up`` again."""
    family, apart = chain.family, s.kinds.apart[block.kind]
    x, (dy, dx) = x_dys
    main, shards = _groups_apart(chain, block)
    rederived = (r, i) in s.recompute
    if rederived:
        chain.task(
            "rec",
            r,
            block.name,
            family_key(family, block.kind, "route_recompute"),
            chain.priced(apart.route.recompute or apart.route.forward, _bytes(chain, main)),
            inputs={
                "x": (x,),
                "w": main,
                "aux_temp": (temps[i],),
                "shared": fwd_shared,
                "segments": seg,
            },
            outputs={"saved": (saved[i], experts[i])},
        )
    shard_work = apart.shard.backward
    if rederived and apart.shard.recompute is not None:
        again = apart.shard.recompute
        shard_work = Work(
            shard_work.flops + again.flops,
            shard_work.bytes + again.bytes,
            shard_work.kernels and shard_work.kernels + again.kernels,
        )
    for group in shards:
        w = group_object("W", block.name, group.name)
        dw = group_object("dW", block.name, group.name)
        roles = grad_roles((dw,) if dw in chain.packed else (), r)
        made = "outputs" if group is shards[0] else "mutates"
        roles.setdefault(made, {})["d_experts"] = (d_experts[i],)
        chain.task(
            "ebwd",
            r,
            block.name,
            family_key(family, block.kind, "experts_backward"),
            chain.priced(shard_work, 2 * _bytes(chain, (w,))),
            inputs={"dy": (dy,), "saved": (experts[i],), "aux_temp": (temps[i],), "w": (w,)},
            outputs=roles.get("outputs", {}),
            mutates=roles.get("mutates", {}),
            group=group.name,
            shard=group.shard,
        )
    grads = tuple(
        g
        for g in (
            group_object("dW", block.name, gr.name) for gr in block.groups if gr.shard is None
        )
        if g in chain.packed
    )
    roles = grad_roles(grads, r)
    aux = (block.aux_object,) if block.aux and r == chain.train.rounds - 1 else ()
    chain.task(
        "bwd",
        r,
        block.name,
        family_key(family, block.kind, "route_backward"),
        chain.priced(apart.route.backward, 2 * _bytes(chain, main)),
        inputs={
            "dy": (dy,),
            "x": (x,),
            "saved": (saved[i],),
            "aux_temp": (temps[i],),
            "aux": aux,
            "w": main,
            "d_experts": (d_experts[i],),
            "shared": shared["inputs"],
            "segments": seg,
        },
        outputs={
            "dx": (dx,) if dx is not None else (),
            "shared": shared["outputs"],
            **roles.get("outputs", {}),
        },
        mutates={"shared": shared["mutates"], **roles.get("mutates", {})},
    )
