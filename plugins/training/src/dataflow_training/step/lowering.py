"""Lower a family + TrainConfig into a Program and its typed step layout.

Tasks, in chain order, for step ``s`` (ids ``{kind}_{s}_{round}_{layer}``), with
``TrainConfig.order == "round"``:

    for each round r:  embed_s_r_emb, fwd_s_r_0 .. fwd_s_r_{L-1}, head_s_r_head,
                       [rec_s_r_i before bwd_s_r_i where recompute or a partial
                        save is chosen]
                       bwd_s_r_{L-1} .. bwd_s_r_0, embbwd_s_r_emb
    then:              one opt_s_{R-1}_<layer>[.<group>] per trainable parameter group,
                       head, blocks L-1 .. 0, emb

With ``TrainConfig.freeze`` (``step.freezing``) the frozen parameters have no ``dW`` or
``O`` and their groups no ``opt`` task; a block with nothing trainable at or below it has
no ``bwd`` (nor ``rec``) task and no ``A``, the lowest block with a backward makes no
``dx``, and a frozen embedding has no ``embbwd``. A frozen ``W`` is only ever read, so a
plan releases it without writing it back.

With ``TrainConfig.lora`` (``step.lora``) every block layer gains a trainable group
``lora`` (``W_<layer>.lora``, its ``dW_`` and ``O_``, one ``opt`` task) holding the
adapters of its target linears, and every other parameter is frozen as above: the
embedding has no ``embbwd``, block 0 makes no ``dx``, the base weights no ``dW``.

With ``order == "layer"`` the same tasks run layer by layer, each layer over every round
(rounds ascending): embed_s_*_emb, fwd_s_*_0, .., fwd_s_*_{L-1}, head_s_*_head, then
[rec_s_r_i,] bwd_s_r_i for every round of block L-1 down to block 0, embbwd_s_*_emb, then
the optimizer tasks as above. ``order == "layer:K"`` does that for rounds 0..K-1, then for
rounds K..2K-1, and so on, before the optimizer tasks.

With early updates (``TrainConfig.updates``: by default in layer orders) and no
all-reduce, each optimizer task then moves to right after the last task that touches its
group's weights or gradient (``step_chain.updates_after_last_use``): with layer order, the last
round's backward of its layer; with round order, opt_s_{R-1}_i follows bwd_s_{R-1}_i.

When the step measures its gradient norm (``TrainConfig.clip`` or ``grad_norm``), a
``gnorm_s_{R-1}_<layer>[.<group>]`` task follows the task that completes each group's
last-round gradient and writes its squared norm ``gn_s_<layer>[.<group>]``; with
``clip`` every optimizer task reads all of them (role ``grad_norm``) and scales its
group's gradient in place (``dW`` becomes a mutate) by the one global clip factor.

Everything that exists at the start (parameters, optimizer state, Aux, every round's
tokens and targets) starts in slow memory; the planner's prologue fetches what the first
tasks need. Objects (see ``dataflow_training.step.family`` for what each holds): ``W``/``dW``/``O`` per
parameter group (gradients: round 0 creates them, later rounds accumulate), ``Aux_i`` (or
``Aux_<kind>`` or ``Aux_<aux_key>``, shared by a kind's or several kinds' layers; the step's first forward to touch an Aux
object zeroes it: its task's ``zero_aux`` param),
per round ``A_s_r_i`` (with a partial save ``p``: only the tensors it keeps, and
``A_s_r_i.p`` the others, which its ``rec`` task re-derives from them) and
``AuxTemp_s_r_i``, hidden states ``y_s_r_i`` (``y_s_r_0`` is
the embedding; block i makes ``y_s_r_{i+1}``), their gradients ``dy_s_r_i``, tokens
``x_s_r``, targets ``t_s_r``, losses ``loss_s_r``. Task inputs by role and every packed
object's layout are in the returned ``StepLayout``. Each round's objects and tasks are
``round_tasks.lower_round``'s; the chain's order, updates, norms and all-reduces
``step_chain``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from dataflow import Link, Links, Program, Role, StateField, TensorMeta
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import (
    Family,
    FamilyContractError,
    LayerCost,
    LayerSpec,
    PartialSave,
    TensorSpec,
    Work,
    embed_layer,
    head_layer,
    load_family,
    partial_saves,
)
from dataflow_training.step.freezing import freeze_layers
from dataflow_training.step.keys import optimizer_key
from dataflow_training.step.layout import LayerInfo, PackedObject, StepLayout
from dataflow_training.step.lora import lora_cost, lora_layers
from dataflow_training.step.optimizers import optimizer_spec
from dataflow_training.step.packing import Layout
from dataflow_training.step.pieces import pieced_layers
from dataflow_training.step.round_tasks import Apart, Kinds, Parameters, Rounds, lower_round
from dataflow_training.step.step_chain import (
    StepChain,
    add_allreduces,
    add_grad_norms,
    group_object,
    layer_major,
    updates_after_last_use,
)


@attrs.frozen
class Lowered:
    """One lowered training step as a value: the program, its typed step layout, the
    family object it was lowered from (with its model config and layers).

    Made by ``lower`` (and by the recompute planner for each candidate), and passed down
    to whatever runs, prices or checks the step: they read roles from ``layout`` and call
    ``family``; none looks the family up by name or parses ``program.metadata`` again.
    A program read from a file becomes one through ``read`` alone."""

    program: Program
    layout: StepLayout
    layers: tuple[LayerSpec, ...]
    family: Family = attrs.field(eq=False, repr=False)
    config: Any = attrs.field(eq=False, repr=False)

    @classmethod
    def read(cls, program: Program, family: Family | None = None) -> Lowered:
        """The step of a program that was lowered and written out (a program JSON file,
        a bundle): its step layout parsed from ``program.metadata`` (the one place it is)
        and its family loaded by the name the layout records (or ``family``, which must
        bear that name). A program not lowered by dataflow-training is a ValueError."""
        layout = StepLayout.of(program)
        if family is None:
            family = load_family(layout.family)
        elif family.name != layout.family:
            raise FamilyContractError(
                f"family object is named {family.name!r} but the program was lowered for "
                f"{layout.family!r}"
            )
        config = family.config(layout.preset, **layout.overrides)
        layers = trained_layers(family.layers(config), layout.train, config)
        return cls(program, layout, layers, family, config)

    def with_program(self, program: Program, layout: StepLayout | None = None) -> Lowered:
        """The same step as ``program`` (planned, re-priced or a recompute candidate of
        this one), with ``layout`` where its tasks differ."""
        return attrs.evolve(self, program=program, layout=layout or self.layout)


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


def trained_layers(layers: Any, train: TrainConfig, config: Any) -> tuple[LayerSpec, ...]:
    """A family's ``layers`` (of ``config``) as ``train`` trains them: LoRA's adapters
    added and the base frozen (``step.lora``), the ``freeze`` patterns applied
    (``step.freezing``), then the vocabulary tables in ``vocab_pieces`` row pieces
    (``step.pieces``)."""
    frozen = freeze_layers(lora_layers(tuple(layers), train.lora), train.freeze)
    return pieced_layers(frozen, train, config)


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
    share and sums it over the fleet (``dataflow_training.drive.fleet``). Those tasks run on the
    collective link (``links.collective``; ``ASSUMED_COLLECTIVE`` when ``links`` has
    none), so each group's all-reduce overlaps the backward of the layers below it.
    """
    overrides = dict(overrides or {})
    config = family.config(preset, **overrides)
    layers = trained_layers(family.layers(config), train, config)
    embed, head = embed_layer(layers), head_layer(layers)
    if layers[0] is not embed or layers[-1] is not head:
        raise FamilyContractError(
            f"family {family.name!r}: layers must run embed, blocks..., head; got "
            f"{[layer.kind for layer in layers]}"
        )
    blocks = layers[1:-1]
    recompute = recompute_units(recompute, train.rounds, len(blocks))
    partial_of = _partial_units(partial or {}, train.rounds, len(blocks), recompute)
    by_name = {layer.name: layer for layer in layers}
    if len(by_name) != len(layers):
        raise FamilyContractError(f"family {family.name!r}: layer names repeat")
    optimizer = optimizer_spec(train.optimizer.name)
    fields = set(train.optimizer.state_dtypes)
    if fields != set(optimizer.state_fields):
        raise ValueError(
            f"optimizer.state_dtypes names {sorted(fields)}; optimizer {optimizer.name!r} "
            f"keeps {sorted(optimizer.state_fields)}"
        )

    kinds_of = {layer.name: layer.kind for layer in layers}
    chain = StepChain(family.name, step, train, kinds_of, cost or RooflineCost())
    params = _add_parameters(chain, layers, by_name, optimizer.state)
    policy = train.dtype
    hidden = TensorMeta(policy.activation, family.hidden_shape(config, train.batch, train.seq_len))
    act_bytes = hidden.nbytes // max(1, math.prod(hidden.shape))
    kinds = _kinds(family, config, layers, train, act_bytes)
    if train.segments:
        _check_segments(family, config, layers)
    if train.head_accumulate == "gradient":
        _check_head_accumulate(family, layers, train)
    if train.block_row_groups > 1:
        _check_row_groups(family, config, layers, train)
    for r, i in sorted(partial_of):
        if blocks[i].kind in kinds.apart:
            raise ValueError(
                f"partial names block {i} of round {r}, whose experts run in "
                f"{kinds.apart[blocks[i].kind].shards} shards: it is re-derived whole or not "
                "at all (the routing task's saves; the shards' object stays saved)"
            )
    for (r, i), name in sorted(partial_of.items()):
        offered = kinds.partial[blocks[i].kind]
        if name not in offered:
            raise ValueError(
                f"partial names {name!r} for block {i} of round {r}; its kind "
                f"{blocks[i].kind!r} offers {', '.join(sorted(offered)) or 'no partial saves'}"
            )
    rounds = Rounds(
        embed,
        blocks,
        head,
        params,
        kinds,
        recompute,
        partial_of,
        hidden,
        TensorMeta("int64", (train.batch, train.seq_len)),
        TensorMeta("int64", (2, train.batch, train.seq_len)) if train.segments else None,
    )
    zeroed: set[str] = set()  # Aux objects the step's forwards have zeroed
    for r in range(train.rounds):
        lower_round(chain, rounds, r, zeroed)

    if train.order != "round":
        names = [layer.name for layer in layers]
        chain.tasks[:] = layer_major(chain.tasks, names, train.order_group)
    if grad_share is not None:
        add_allreduces(chain, grad_share, params.grads)
    norms = add_grad_norms(chain, params.grads)
    _add_updates(chain, (head, *reversed(blocks), embed), norms)
    if train.early_updates and grad_share is None:
        chain.tasks[:] = updates_after_last_use(chain.tasks)
    program, layout = _lowered(
        chain, preset, overrides, layers, norms, keep_grads, keep_aux_temp, links, grad_share
    )
    return Lowered(program, layout, layers, family, config)


def layer_role(layer: LayerSpec, layers: Sequence[LayerSpec]) -> str:
    """``embed``, ``head`` or ``block``: where ``layer`` sits in the step's ``layers``
    (what an optimizer's ``StateField.shape`` and update tell matrices apart by)."""
    if layer is layers[0]:
        return "embed"
    return "head" if layer is layers[-1] else "block"


def _add_parameters(
    chain: StepChain,
    layers: tuple[LayerSpec, ...],
    by_name: Mapping[str, LayerSpec],
    state_fields: tuple[StateField, ...],
) -> Parameters:
    """Each layer's parameter groups as objects: ``W`` (every parameter, in the param
    dtype), and for a group with trainable ones ``dW`` (grad dtype) and ``O`` (the
    optimizer's state fields of each, shaped by the field's rule for the parameter and
    its layer's role, in their dtypes); then its ``Aux``."""
    train, family = chain.train, chain.family
    policy = train.dtype
    weights: dict[str, tuple[str, ...]] = {}
    grads: dict[str, tuple[str, ...]] = {}
    param_bytes: dict[str, int] = {}
    for layer in layers:
        weights[layer.name], grads[layer.name] = (), ()
        for group in layer.groups:
            params = _ordered(group.params)
            trainable = [p for p in params if p.trainable]
            w_id = group_object("W", layer.name, group.name)
            w_layout = Layout.pack((p.name, p.shape, _dtype(p, policy.param)) for p in params)
            chain.add_packed(
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
            chain.add_packed(
                PackedObject(dw_id, "dW", layer.name, dw_layout, group.name), Role.GRAD
            )
            role = layer_role(layer, layers)
            states = [
                (f"{p.name}/{f.name}", f.shape(p.shape, role), train.optimizer.state_dtypes[f.name])
                for f in state_fields
                for p in trainable
            ]
            o_id = group_object("O", layer.name, group.name)
            chain.add_packed(
                PackedObject(o_id, "O", layer.name, Layout.pack(states), group.name),
                Role.OPT_STATE,
            )
            grads[layer.name] += (dw_id,)
        param_bytes[layer.name] = sum(
            chain.packed[w].layout.size_bytes for w in weights[layer.name]
        )
        if layer.aux:
            _add_aux(family, layer, chain.packed, chain.add_packed)
    head = layers[-1]
    for local, target in head.tied.items():
        owner, _, name = target.partition(".")
        if owner not in by_name or name not in {p.name for p in by_name[owner].params}:
            raise FamilyContractError(
                f"family {family!r}: head ties {local!r} to {target!r}, which no layer declares"
            )
    tied = tuple(sorted({target.partition(".")[0] for target in head.tied.values()}))
    return Parameters(weights, grads, param_bytes, tied)


def _check_head_accumulate(family: Any, layers: Any, train: TrainConfig) -> None:
    """``head_accumulate="gradient"`` adds into the head's own 16-bit gradient object: a
    ValueError naming what stands in the way (a tied head's gradient is the embedding's,
    shared with another task; float32 weights have no 16-bit gradient to add into)."""
    head = head_layer(layers)
    if head.tied:
        raise ValueError(
            f"head_accumulate='gradient' (--head-accumulate): the head of family "
            f"{family.name!r} is tied to its embedding (its gradient goes to the "
            "embedding's object); use 'float32'"
        )
    policy = train.dtype
    if policy.param not in ("bfloat16", "float16") or policy.grad != policy.param:
        raise ValueError(
            "head_accumulate='gradient' (--head-accumulate) adds into a 16-bit gradient of "
            "the weights' dtype; "
            f"the weights are {policy.param}, their gradients {policy.grad}: use 'float32'"
        )


def _check_row_groups(
    family: Family, config: Any, layers: tuple[LayerSpec, ...], train: TrainConfig
) -> None:
    """``block_row_groups`` > 1 runs each block task's math over groups of the round's
    sequences (``drive.tasks``): a ValueError naming what stands in the way. The groups
    must be independent and their results rows of the task's objects: no routing
    (AuxTemp), Aux, leader or loss term of a block's own (each sums or decides over the
    whole batch), every saved tensor batch-major (its first dimension ``batch`` times
    that of one sequence), no segments and no LoRA (their per-round inputs are not cut)."""
    option = f"block_row_groups={train.block_row_groups} (--block-row-groups)"
    if train.segments:
        raise ValueError(f"{option} cannot go with segments (--pack-documents)")
    if train.lora is not None:
        raise ValueError(f"{option} cannot go with LoRA (--lora)")
    batch, seq = train.batch, train.seq_len
    for block in layers[1:-1]:
        math_ = family.math(block.kind)
        where = f"{option}: family {family.name!r}, layer {block.name!r} ({block.kind!r})"
        if block.aux or block.leader or hasattr(math_, "objective"):
            raise ValueError(
                f"{where} has Aux, a leader or a loss term of its own, summed over the "
                "whole batch; use 1"
            )
        if math_.aux_temp(config, batch, seq):
            raise ValueError(f"{where} routes (AuxTemp), decided over the whole batch; use 1")
        one = {spec.name: tuple(spec.shape) for spec in math_.saved(config, 1, seq)}
        for spec in math_.saved(config, batch, seq):
            shape, single = tuple(spec.shape), one.get(spec.name)
            if single is None or shape != (single[0] * batch, *single[1:]):
                raise ValueError(
                    f"{where} saves {spec.name!r} of shape {shape}, not batch-major; use 1"
                )


def _check_segments(family: Family, config: Any, layers: tuple[LayerSpec, ...]) -> None:
    """A segmented step (``TrainConfig.segments``) of ``family``: every block kind, and
    the embedding, must take segments (``BlockMath``'s ``refuses_segments``); one that
    does not is a one-line ValueError naming the family, the kind and the part."""
    for kind in (*sorted({block.kind for block in layers[1:-1]}), "embed"):
        math_ = family.math(kind)
        refuses = getattr(math_, "refuses_segments", None)
        part = type(math_).__name__ if refuses is None else refuses(config)
        if part:
            raise ValueError(
                f"family {family.name!r}: {kind!r} takes no segments (padded or packed "
                f"batches: TrainConfig.segments, --pack-documents): its {part} does not"
            )


def _kinds(
    family: Family,
    config: Any,
    layers: tuple[LayerSpec, ...],
    train: TrainConfig,
    act_bytes: int,
) -> Kinds:
    """Each block kind's saved, partial and AuxTemp layouts and its cost; the embed's and
    the head's costs."""
    policy = train.dtype
    saved_layout, temp_layout, block_cost = {}, {}, {}
    partial_layouts: dict[str, dict[str, tuple[Layout, Layout]]] = {}
    apart: dict[str, Apart] = {}
    for kind in sorted({block.kind for block in layers[1:-1]}):
        kind_math = family.math(kind)
        found = _apart(family, config, layers, kind, kind_math, train, act_bytes)
        if found is not None:
            apart[kind] = found
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
        if train.lora is not None:  # the adapters' matmuls, and no dW of their targets
            layer = next(block for block in layers[1:-1] if block.kind == kind)
            block_cost[kind] = lora_cost(block_cost[kind], layer, train.tokens_per_round, act_bytes)
        missing = set(partial_layouts[kind]) - set(block_cost[kind].partial)
        if missing:
            raise FamilyContractError(
                f"family {family.name!r}: block kind {kind!r} declares partial save(s) "
                f"{sorted(missing)} but its cost gives no LayerCost.partial work for them"
            )
    embed_cost = family.math("embed").cost(config, train.batch, train.seq_len, act_bytes)
    head_cost = _head_cost(family, config, train, layers[0], act_bytes)
    shared = _shared_targets(family, config, layers, train, temp_layout)
    return Kinds(
        saved_layout,
        partial_layouts,
        temp_layout,
        block_cost,
        embed_cost,
        head_cost,
        apart,
        shared,
    )


def _shared_targets(
    family: Family,
    config: Any,
    layers: tuple[LayerSpec, ...],
    train: TrainConfig,
    temp_layout: dict[str, Layout | None],
) -> dict[str, Layout]:
    """The layout of the KL target object of each block kind that leads followers
    (``LayerSpec.leader``, ``BlockMath.shared_target``); a leader that is no earlier
    block, has no AuxTemp or declares no target is an error naming the layer."""
    blocks = layers[1:-1]
    index = {block.name: i for i, block in enumerate(blocks)}
    out: dict[str, Layout] = {}
    for i, block in enumerate(blocks):
        if not block.leader:
            continue
        where = f"family {family.name!r}: layer {block.name!r} follows {block.leader!r}"
        if index.get(block.leader, i) >= i:
            raise FamilyContractError(f"{where}, which is no earlier block")
        lead = blocks[index[block.leader]]
        if lead.leader or temp_layout[lead.kind] is None:
            raise FamilyContractError(f"{where}, which makes no selection of its own")
        kind_math = family.math(lead.kind)
        if not hasattr(kind_math, "shared_target"):
            raise FamilyContractError(
                f"{where}, whose kind {lead.kind!r} declares no shared_target"
            )
        specs = kind_math.shared_target(config, train.batch, train.seq_len)
        out[lead.kind] = Layout.pack((s.name, s.shape, s.dtype) for s in specs)
    return out


def _apart(
    family: Family,
    config: Any,
    layers: tuple[LayerSpec, ...],
    kind: str,
    kind_math: Any,
    train: TrainConfig,
    act_bytes: int,
) -> Apart | None:
    """How block kind ``kind`` runs its experts apart (``BlockMath.experts_apart``: more
    than one shard), or None where it runs whole; its layers' shard groups must be the
    shards it says."""
    shards = kind_math.experts_apart(config) if hasattr(kind_math, "experts_apart") else 1
    for layer in layers[1:-1]:
        found = sorted(g.shard for g in layer.groups if g.shard is not None)
        wanted = [(j, shards) for j in range(shards)] if shards > 1 else []
        if layer.kind == kind and found != wanted:
            raise FamilyContractError(
                f"family {family.name!r}: block kind {kind!r} runs its experts in {shards} "
                f"shard(s) but layer {layer.name!r} declares shard groups {found}"
            )
    if shards == 1:
        return None
    if train.lora is not None:
        raise ValueError(
            f"LoRA is not offered for block kind {kind!r}, whose experts run in {shards} "
            "shards; set the config's expert_shards to 1"
        )
    batch, seq_len, policy = train.batch, train.seq_len, train.dtype
    main, experts, grad = kind_math.apart_saved(config, batch, seq_len)
    route, one = kind_math.apart_cost(config, batch, seq_len, act_bytes, shards)
    inputs = tuple(spec for spec in experts if spec.name == "moe_in")  # re-derived: no rows
    if not inputs:
        raise FamilyContractError(
            f"family {family.name!r}: block kind {kind!r} runs its experts apart but its "
            "experts' object (apart_saved) has no 'moe_in', their input"
        )
    return Apart(
        shards,
        _pack(main, policy.activation),
        _pack(experts, policy.activation),
        _pack(grad, policy.activation),
        route,
        one,
        _pack(inputs, policy.activation),
    )


def _head_cost(
    family: Family, config: Any, train: TrainConfig, embed: LayerSpec, act_bytes: int
) -> LayerCost:
    """The head's cost; with ``head_vocab_tiles``, the logits made again, tile by tile,
    over every token."""
    head_cost = family.math("head").cost(config, train.batch, train.seq_len, act_bytes)
    if not train.head_vocab_tiles:
        return head_cost
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
    return attrs.evolve(head_cost, forward=again)


def _add_updates(chain: StepChain, layers: tuple[LayerSpec, ...], norms: tuple[str, ...]) -> None:
    """One optimizer task per trainable group, of ``layers`` in that order (head, blocks
    from the top, embed): it reads the gradient (or, with a clip, scales it in place by
    the factor the ``norms`` give) and updates the weights and the optimizer state; a
    group holding a tensor updated by a rule (``TensorSpec.rule``) also reads its layer's
    Aux."""
    train, packed = chain.train, chain.packed
    key = optimizer_key(train.optimizer.name)
    clipped = train.clip is not None  # the update scales dW in place
    for layer in layers:
        for group in layer.groups:
            dw_id = group_object("dW", layer.name, group.name)
            if dw_id not in packed:
                continue  # nothing trainable in this group
            # a tensor updated by a rule from the layer's Aux (TensorSpec.rule)
            ruled = any(p.rule is not None for p in group.params)
            if ruled and not layer.aux:
                raise FamilyContractError(
                    f"family {chain.family!r}: layer {layer.name!r} has a tensor updated by "
                    "a rule (TensorSpec.rule) but declares no Aux for the rule to read"
                )
            aux = (layer.aux_object,) if ruled else ()
            w_id = group_object("W", layer.name, group.name)
            o_id = group_object("O", layer.name, group.name)
            moved = (
                2 * packed[w_id].layout.size_bytes
                + packed[dw_id].layout.size_bytes
                + 2 * packed[o_id].layout.size_bytes
            )
            chain.task(
                "opt",
                train.rounds - 1,
                layer.name,
                key,
                chain.cost.cost_us(0, moved),
                inputs={
                    "grad": () if clipped else (dw_id,),
                    "grad_norm": norms if clipped else (),
                    "aux": aux,
                },
                mutates={
                    "w": (w_id,),
                    "opt_state": (o_id,),
                    "grad": (dw_id,) if clipped else (),
                },
                group=group.name,
            )


def _lowered(
    chain: StepChain,
    preset: str,
    overrides: dict[str, Any],
    layers: tuple[LayerSpec, ...],
    norms: tuple[str, ...],
    keep_grads: bool,
    keep_aux_temp: bool,
    links: Links | None,
    grad_share: float | None,
) -> tuple[Program, StepLayout]:
    """The Program of ``chain`` and its step layout: weights, optimizer state, Aux, the
    losses and the gradient norms end in slow memory (the gradients and AuxTemp too, when
    kept for checks)."""
    packed, step = chain.packed, chain.step
    finals = {p.id: "slow" for p in packed.values() if p.kind in ("W", "O", "Aux")}
    finals |= {f"loss_{step}_{r}": "slow" for r in range(chain.train.rounds)}
    finals |= {gn: "slow" for gn in norms}
    if keep_grads:
        finals |= {p.id: "slow" for p in packed.values() if p.kind == "dW"}
    if keep_aux_temp:
        finals |= {p.id: "slow" for p in packed.values() if p.kind == "AuxTemp"}
    step_layout = StepLayout(
        family=chain.family,
        preset=preset,
        overrides=overrides,
        train=chain.train,
        step=step,
        layers=tuple(
            LayerInfo(layer.name, layer.kind, tuple(g.name for g in layer.groups), layer.tied)
            for layer in layers
        ),
        tasks=chain.slots,
        packed=packed,
    )
    program = Program(
        name=f"{chain.family}-{preset}-train",
        objects=tuple(chain.objects),
        tasks=tuple(chain.tasks),
        final_locations=finals,
        persistent=tuple(p.id for p in packed.values() if p.kind in ("W", "O", "Aux")),
        links=_step_links(links, grad_share),
        metadata=step_layout.to_metadata(),
    )
    return program, step_layout


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
            f"{[(a.name, a.shape) for a in layer.aux]} but {obj}, which it shares, was "
            f"declared by layer {packed[obj].layer!r} with others"
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
