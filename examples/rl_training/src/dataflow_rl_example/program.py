"""The policy update as a dataflow Program: a bare chain that PressureFit plans.

The engine that sampled the rollouts already ran the forward pass, so the update runs none
again: it starts from the hidden states the engine saved. For every block ``l``:

- ``recompute_l`` (``W_l``, ``h_l`` -> ``A_l``, ``T_l``, ``h_{l+1}``): the block's forward on
  its handed-over input ``h_l``, keeping what its backward needs (``A_l``: the saved
  context; ``T_l``: an MoE block's router choices, which backward reads verbatim). It
  writes its output ``h_{l+1}`` only where the engine did not hand that over: with hidden
  states saved every ``k`` layers, a span's recompute tasks rebuild the ``k - 1`` inputs
  between, and the last block's output ``h_L`` (the head's input: engines expose the final
  hidden state after the final norm only).
- ``backward_l`` (``W_l``, ``h_l``, ``A_l``, ``T_l``, ``dh_{l+1}`` -> ``dh_l``, ``dW_l``), then
  ``adamw_l`` (changes ``W_l`` and its moments ``O_l`` in place).

The chain runs span by span from the last: the last span's recomputes, the ``head`` (final
norm, logits chunk by chunk, the policy loss and its gradient ``dh_L``), the span's
backwards; then the span before it, recomputes then backwards, and so on. A span's saved
contexts live only while it runs. ``embed_backward`` ends the chain (the token table's
gradient needs only the tokens and ``dh_0``), then ``adamw_emb``. Without ``h_0`` (no
hidden states handed over) an ``embed`` task makes it from the tokens.

Objects: parameters ``W_<layer>[.<group>]``, moments ``O_...`` and the loss's ``stats`` end
in slow memory; the rollout's tensors start there (``tokens``, ``targets``, ``scored``,
``behaviour``, ``ref``, ``rewards``, ``groups``, ``h_<l>``). Task costs come from the
family's declared work over an assumed rate (``UpdateOptions.flops_per_us``), transfers
from ``UpdateOptions.link_bytes_per_us``; ``dataflow
plan --measured`` prices them by measurement instead.
"""

from __future__ import annotations

from typing import Any

import attrs

from dataflow import Link, Links, Obj, Program, Task, TensorMeta
from dataflow_rl_example.loss import LOSSES
from dataflow_rl_example.packing import Packing

#: the dtypes parameters, their gradients and activations may have (``UpdateOptions.dtype``),
#: and AdamW's moments (``UpdateOptions.moments``); the rollouts' log-probs and rewards and
#: the stats are float32 always
DTYPES = ("float32", "bfloat16")
STATE = "float32"  # the rollouts' scalars' dtype


@attrs.frozen
class UpdateOptions:
    """What one policy update computes (per-run values aside: ``lr``, ``kl_coef``)."""

    loss: str = attrs.field(default="grpo")
    clip_eps: float = 0.2
    kl: bool = False  # the KL term to the reference (rollouts then carry ref_logprobs)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: parameters, gradients and activations: float32, or bfloat16 (the update's own math
    #: in float32 where it matters: log-probs and loss, AdamW's moments and step)
    dtype: str = attrs.field(default="float32")
    #: AdamW's moments as stored (the step's math is float32 either way): bfloat16 halves
    #: them, as stock ``AdamW(fused=True)`` over bfloat16 parameters keeps its state
    moments: str = attrs.field(default="float32")
    chunk_tokens: int = 1024
    #: the rates the plan assumes: compute in FLOP/us, each direction of the host link in
    #: bytes/us (benchmarks/rl_update.py takes them from the hardware table)
    flops_per_us: float = 20_000.0
    link_bytes_per_us: float = 10_000.0

    @loss.validator
    def _loss(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {value!r}")

    @dtype.validator
    @moments.validator
    def _dtype(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in DTYPES:
            raise ValueError(f"{attribute.name} must be one of {', '.join(DTYPES)}, got {value!r}")

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(eq=False)
class UpdateStep:
    """A lowered policy update: the bare program and what its executables need."""

    family: Any
    config: Any
    options: UpdateOptions
    rows: int
    length: int  # tokens per row; the model reads length - 1 of them
    hidden_layers: tuple[int, ...]
    layers: tuple[Any, ...]  # the family's LayerSpecs, embed first, head last
    packings: dict[str, Packing]  # every packed object's table, by object id
    program: Program

    @property
    def blocks(self) -> tuple[Any, ...]:
        return self.layers[1:-1]

    def param_objects(self, layer: Any) -> dict[str, Any]:
        """``{object id: ParamGroup}`` of a layer's parameter groups."""
        return {param_object(layer, group): group for group in layer.groups}


def param_object(layer: Any, group: Any) -> str:
    return f"W_{layer.name}" + (f".{group.name}" if group.name else "")


def _named(specs: Any, dtype: str) -> Packing:
    """The packing of ``specs``, the family's ``"policy"`` dtype as ``dtype``."""
    return Packing.of(
        (spec.name, dtype if spec.dtype == "policy" else spec.dtype, spec.shape) for spec in specs
    )


def lower_update(
    family: Any,
    config: Any,
    *,
    rows: int,
    length: int,
    hidden_layers: tuple[int, ...] = (),
    options: UpdateOptions = UpdateOptions(),
) -> UpdateStep:
    """The bare chain of one update of ``rows`` rollouts of ``length`` tokens whose engine
    handed over the inputs of blocks ``hidden_layers``."""
    layers = tuple(family.layers(config))
    blocks, embed, head = layers[1:-1], layers[0], layers[-1]
    count, seq = len(blocks), length - 1
    handed = tuple(sorted(set(hidden_layers)))
    if any(not 0 <= layer < count for layer in handed):
        raise ValueError(f"hidden layers {list(handed)}: the model has blocks 0..{count - 1}")
    for layer in layers:
        if any(group.shard for group in layer.groups):
            raise ValueError(f"layer {layer.name}: experts stored in shards are not supported")
    if seq < 1:
        raise ValueError(f"rollouts of {length} token(s): the update needs at least 2")

    packings: dict[str, Packing] = {}
    objects: list[Obj] = []

    def add(oid: str, role: str, dtype: str, shape: tuple[int, ...], location="slow") -> None:
        meta = TensorMeta(dtype, shape)
        objects.append(Obj(oid, meta.nbytes, role, location, meta))

    def add_packed(oid: str, role: str, packing: Packing, location="slow") -> None:
        packings[oid] = packing
        objects.append(Obj(oid, packing.size_bytes, role, location, packing.meta()))

    final: dict[str, str] = {"stats": "slow"}
    dtype = options.dtype
    for layer in layers:
        for oid, group in ((param_object(layer, g), g) for g in layer.groups):
            trainable = [p for p in group.params if p.trainable]
            add_packed(oid, "param", _named(group.params, dtype))
            add_packed("d" + oid, "grad", _named(trainable, dtype))
            moments = [
                (f"{m}.{p.name}", options.moments, p.shape) for m in ("m", "v") for p in trainable
            ]
            add_packed("O" + oid[1:], "opt_state", Packing.of(moments))
            final |= {oid: "slow", "O" + oid[1:]: "slow"}

    hidden = family.hidden_shape(config, rows, seq)
    for name, kind in (("tokens", "int64"), ("targets", "int64"), ("scored", STATE)):
        add(name, "data", kind, (rows, seq))
    add("behaviour", "data", STATE, (rows, seq))
    if options.kl:
        add("ref", "data", STATE, (rows, seq))
    add("rewards", "data", STATE, (rows,))
    add("groups", "data", "int64", (rows,))
    for index in range(count + 1):
        role = "data" if index in handed else "activation"
        add(f"h_{index}", role, dtype, hidden)
        add(f"dh_{index}", "grad", dtype, hidden)
    for index, block in enumerate(blocks):
        math = family.math(block.kind)
        add_packed(f"A_{index}", "activation", _named(math.saved(config, rows, seq), dtype))
        aux_temp = math.aux_temp(config, rows, seq)
        if aux_temp:
            add_packed(f"T_{index}", "aux_temp", _named(aux_temp, dtype))
    add("stats", "output", STATE, (len(STATS),))

    rate = options.flops_per_us

    def cost(layer: Any, part: str) -> float:
        work = family.math(layer.kind).cost(config, rows, seq, 4)
        chosen = {"forward": work.forward, "backward": work.backward}[part]
        if part == "forward" and work.recompute is not None:
            chosen = work.recompute
        return max(chosen.flops / rate, 1.0)

    def weights(layer: Any) -> tuple[str, ...]:
        return tuple(param_object(layer, group) for group in layer.groups)

    def adamw(layer: Any) -> list[Task]:
        return [
            Task(
                f"adamw_{oid[2:]}",
                "optimizer",
                "rl.adamw",
                params={"object": oid},
                inputs=("d" + oid,),
                mutates=(oid, "O" + oid[1:]),
                cost_us=max(packings[oid].size_bytes * 4 / rate, 1.0),
            )
            for oid in weights(layer)
        ]

    tied = tuple(weights(embed)) if head.tied else ()
    head_inputs = (*weights(head), *tied, f"h_{count}", "targets", "scored", "behaviour")
    head_inputs += ("ref",) if options.kl else ()
    head_task = Task(
        "head",
        "head",
        "rl.head",
        inputs=(*head_inputs, "rewards", "groups"),
        outputs=(
            f"dh_{count}",
            *("d" + oid for oid in weights(head)),
            *("d" + o for o in tied),
            "stats",
        ),
        cost_us=cost(head, "forward"),
    )
    tasks: list[Task] = []
    starts = sorted({0, *handed})
    spans = list(zip(starts, [*starts[1:], count], strict=True))
    for first, end in reversed(spans):
        if first == 0 and 0 not in handed:
            tasks.append(
                Task(
                    "embed",
                    "embed",
                    "rl.embed",
                    inputs=(*weights(embed), "tokens"),
                    outputs=("h_0",),
                    cost_us=1.0,
                )
            )
        for index in range(first, end):
            block = blocks[index]
            made = (f"T_{index}",) if f"T_{index}" in packings else ()
            following = (f"h_{index + 1}",) if index + 1 not in handed else ()
            tasks.append(
                Task(
                    f"recompute_{index}",
                    "recompute",
                    "rl.recompute",
                    params={"layer": index},
                    inputs=(*weights(block), f"h_{index}"),
                    outputs=(f"A_{index}", *made, *following),
                    cost_us=cost(block, "forward"),
                )
            )
        if end == count:
            tasks += [head_task, *([] if head.tied else adamw(head))]
        for index in reversed(range(first, end)):
            block = blocks[index]
            temp = (f"T_{index}",) if f"T_{index}" in packings else ()
            tasks.append(
                Task(
                    f"backward_{index}",
                    "backward",
                    "rl.backward",
                    params={"layer": index},
                    inputs=(*weights(block), f"h_{index}", f"A_{index}", *temp, f"dh_{index + 1}"),
                    outputs=(f"dh_{index}", *("d" + oid for oid in weights(block))),
                    cost_us=cost(block, "backward"),
                )
            )
            tasks += adamw(block)
    embed_grads = tuple("d" + oid for oid in weights(embed))
    tasks.append(
        Task(
            "embed_backward",
            "embed_backward",
            "rl.embed_backward",
            inputs=("tokens", "dh_0"),
            mutates=embed_grads if tied else (),
            outputs=() if tied else embed_grads,
            cost_us=1.0,
        )
    )
    tasks += adamw(embed) + (adamw(head) if head.tied else [])
    used = {oid for task in tasks for oid in task.uses}
    program = Program(
        name=f"rl-update-{family.name}",
        objects=tuple(obj for obj in objects if obj.id in used),
        tasks=tuple(tasks),
        final_locations={oid: where for oid, where in final.items() if oid in used},
        links=Links(
            h2d=Link(options.link_bytes_per_us, 5.0), d2h=Link(options.link_bytes_per_us, 5.0)
        ),
        metadata={
            "example": "rl_training",
            "family": family.name,
            "config": family.config_to_hf(config, _torch_float32()),
            "rows": rows,
            "length": length,
            "hidden_layers": list(handed),
            "options": options.as_json(),
        },
    )
    return UpdateStep(family, config, options, rows, length, handed, layers, packings, program)


#: what the head writes into ``stats``
STATS = ("loss", "ratio", "clipped", "kl")


def _torch_float32() -> Any:
    import torch

    return torch.float32
