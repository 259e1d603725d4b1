"""The forward-only step of a family: what an evaluation runs (``drive.evaluation``).

``lower_forward`` lowers the training step's forward half, one round, and nothing else:

    embed_s_0_emb, fwd_s_0_0 .. fwd_s_0_{L-1} (each with ``save`` False), head_s_0_head

A block whose experts run in several shards (``kit.moe.expert_shards``) is its routing
``fwd`` and one ``efwd`` a shard, as in training (``round_tasks.apart_forward``), with the
experts' object (their input and ``gate_up``) made and read within the block: no task
holds more than one shard's weights here either.

No task saves activations, none makes a gradient, and there are no ``rec``, ``bwd``,
``gnorm`` or optimizer tasks, so no ``A``, ``dW`` or ``O`` objects. The objects are the
training step's ``W`` (packed alike, so a model state fills them the same way), the
blocks' ``Aux`` (which their forwards update as in training: in the evaluation's own
engine, never the training run's) and AuxTemp, the round's tokens, targets, hidden states
and its loss. The head task is the training step's fused ``head.loss`` with only its
``loss`` output: its executable (``drive.tasks.HeadLoss``) keeps the loss and drops the
gradients the fused kernel makes (the same work as training's head, so the same price
and workspace: a loss-only head phase would be cheaper, and is not written yet).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from dataflow import Obj, Program, Role, TensorMeta
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import Family, FamilyContractError, embed_layer, head_layer
from dataflow_training.step.keys import family_key
from dataflow_training.step.layout import LayerInfo, PackedObject, StepLayout
from dataflow_training.step.lora import lora_layers
from dataflow_training.step.lowering import (
    Lowered,
    _add_aux,
    _apart,
    _dtype,
    _ordered,
    _step_links,
)
from dataflow_training.step.packing import Layout
from dataflow_training.step.pieces import pieced_layers
from dataflow_training.step.round_tasks import apart_forward
from dataflow_training.step.step_chain import StepChain, group_object


def lower_forward(
    family: Family,
    preset: str,
    train: TrainConfig,
    *,
    overrides: dict[str, Any] | None = None,
    cost: RooflineCost | None = None,
    links: Any = None,
) -> Lowered:
    """The forward-only Program of ``family``'s ``preset`` at ``train``'s batch and
    sequence length (its ``rounds`` are ignored: the step is one round; module docstring)."""
    overrides = dict(overrides or {})
    train = attrs.evolve(train, rounds=1)
    config = family.config(preset, **overrides)
    layers = lora_layers(family.layers(config), train.lora)  # LoRA's adapters and base
    layers = pieced_layers(layers, train, config)  # (step.pieces)
    embed, head = embed_layer(layers), head_layer(layers)
    blocks = layers[1:-1]
    chain = StepChain(
        family.name, 0, train, {layer.name: layer.kind for layer in layers}, cost or RooflineCost()
    )
    weights: dict[str, tuple[str, ...]] = {}
    for layer in layers:
        weights[layer.name] = ()
        for group in layer.groups:
            params = _ordered(group.params)
            w_id = group_object("W", layer.name, group.name)
            packed = Layout.pack((p.name, p.shape, _dtype(p, train.dtype.param)) for p in params)
            decay = tuple(p.name for p in params if p.trainable and p.decay)
            chain.add_packed(
                PackedObject(w_id, "W", layer.name, packed, group.name, decay), Role.PARAM
            )
            weights[layer.name] += (w_id,)
        if layer.aux:
            _add_aux(family.name, layer, chain.packed, chain.add_packed)
    param_bytes = {
        name: sum(chain.packed[w].layout.size_bytes for w in ids) for name, ids in weights.items()
    }
    hidden = TensorMeta(
        train.dtype.activation, family.hidden_shape(config, train.batch, train.seq_len)
    )
    act_bytes = hidden.nbytes // max(1, math.prod(hidden.shape))
    tokens = TensorMeta("int64", (train.batch, train.seq_len))
    x, t, loss = "x_0_0", "t_0_0", "loss_0_0"
    y = [f"y_0_0_{i}" for i in range(len(blocks) + 1)]
    chain.objects += [
        Obj(x, tokens.nbytes, Role.DATA, "slow", tokens),
        Obj(t, tokens.nbytes, Role.DATA, "slow", tokens),
        Obj(loss, 4, Role.OUTPUT, tensor=TensorMeta("float32", ())),
        *(Obj(name, hidden.nbytes, Role.ACTIVATION, tensor=hidden) for name in y),
    ]
    embed_cost = family.math("embed").cost(config, train.batch, train.seq_len, act_bytes)
    chain.task(
        "embed",
        0,
        embed.name,
        family_key(family.name, "embed", "forward"),
        chain.priced(embed_cost.forward, 0),
        inputs={"tokens": (x,), "w": weights[embed.name]},
        outputs={"y": (y[0],)},
    )
    zeroed: set[str] = set()
    index = {block.name: i for i, block in enumerate(blocks)}

    def shared(block: Any) -> tuple[str, ...]:
        return (f"AuxTemp_0_0_{index[block.leader]}",) if block.leader else ()

    aparts: dict[str, Any] = {}  # block kind -> how its experts run apart (None: whole)
    for i, block in enumerate(blocks):
        kind_math = family.math(block.kind)
        if block.kind not in aparts:
            aparts[block.kind] = _apart(
                family, config, layers, block.kind, kind_math, train, act_bytes
            )
        temp: tuple[str, ...] = ()
        temp_specs = kind_math.aux_temp(config, train.batch, train.seq_len)
        if temp_specs:
            layout = Layout.pack(
                (s.name, s.shape, _dtype(s, train.dtype.activation)) for s in temp_specs
            )
            temp = (f"AuxTemp_0_0_{i}",)
            chain.packed[temp[0]] = PackedObject(temp[0], "AuxTemp", block.name, layout)
            chain.objects.append(Obj(temp[0], layout.size_bytes, Role.AUX_TEMP))
        aux = (block.aux_object,) if block.aux else ()
        zero_aux = bool(aux) and aux[0] not in zeroed
        zeroed.update(aux)
        apart = aparts[block.kind]
        if apart is not None:  # the routing task, then one task a shard, as in training
            experts = f"A_0_0_{i}.experts"  # their input alone: no backward reads gate_up
            chain.packed[experts] = PackedObject(experts, "A", block.name, apart.inputs)
            chain.objects.append(Obj(experts, apart.inputs.size_bytes, Role.ACTIVATION))
            apart_forward(
                chain, apart, 0, i, block, (y[i], y[i + 1]), {}, {i: temp[0]}, {i: experts},
                zero_aux, shared(block),
            )  # fmt: skip
            continue
        work = kind_math.cost(config, train.batch, train.seq_len, act_bytes).forward
        chain.task(
            "fwd",
            0,
            block.name,
            family_key(family.name, block.kind, "forward"),
            chain.priced(work, param_bytes[block.name]),
            # a shared-index layer reads its leader's selection
            inputs={"x": (y[i],), "w": weights[block.name], "shared": shared(block)},
            mutates={"aux": aux},
            outputs={"y": (y[i + 1],), "aux_temp": temp},
            save=False,
            zero_aux=zero_aux,
        )
    tied = tuple(sorted({target.partition(".")[0] for target in head.tied.values()}))
    tied_w = tuple(w for name in tied for w in weights[name])
    if any(name not in weights for name in tied):
        raise FamilyContractError(f"family {family.name!r}: head ties to {tied}, not all layers")
    head_cost = family.math("head").cost(config, train.batch, train.seq_len, act_bytes)
    tied_bytes = sum(chain.packed[w].layout.size_bytes for w in tied_w)
    chain.task(
        "head",
        0,
        head.name,
        family_key(family.name, "head", "loss"),
        chain.priced(head_cost.forward, param_bytes[head.name] + tied_bytes),
        inputs={"x": (y[-1],), "targets": (t,), "w": weights[head.name], "tied": tied_w},
        outputs={"loss": (loss,)},
    )
    kept = [p.id for p in chain.packed.values() if p.kind in ("W", "Aux")]
    layout = StepLayout(
        family=family.name,
        preset=preset,
        overrides=overrides,
        train=train,
        step=0,
        layers=tuple(
            LayerInfo(layer.name, layer.kind, tuple(g.name for g in layer.groups), layer.tied)
            for layer in layers
        ),
        tasks=chain.slots,
        packed=chain.packed,
    )
    program = Program(
        name=f"{family.name}-{preset}-eval",
        objects=tuple(chain.objects),
        tasks=tuple(chain.tasks),
        final_locations={**dict.fromkeys(kept, "slow"), loss: "slow"},
        persistent=tuple(kept),
        links=_step_links(links, None),
        metadata=layout.to_metadata(),
    )
    return Lowered(program, layout, layers, family, config)
