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

Rounds (``UpdateOptions.rounds``, ``R``): the rows split into ``R`` equal micro-batches,
so an update may take more rows than one block's saved context for all of them would
leave room for. Every object that scales with the rows is one per round, its id
suffixed ``_r<round>`` (``h_l_r0``, ``dh_l_r0``, ``A_l_r0``, ``T_l_r0``, ``tokens_r0``,
``targets_r0``, ``scored_r0``, ``behaviour_r0``, ``ref_r0``), as is every task that reads
them (``recompute_l_r0``, ``head_r0``, ``backward_l_r0``, ``embed_r0``,
``embed_backward_r0``); ``rewards`` and ``groups`` stay whole. Within a span the tasks run
round by round (the round's recomputes, at the last span its head, its backwards), so
one round's saved contexts of the span live at a time; round 0's backward writes
``dW_l`` and later rounds' add to it (they mutate it), and ``adamw_l`` follows the last
round's backward: a block's weights and moments are fetched once an update whatever the
rows. Each round's head weighs its tokens and takes its advantages from every round's
``scored`` and the whole ``rewards`` and ``groups`` (a group may straddle rounds), so the
rounds' gradients and ``stats`` sum to the one-round update's; the head's gradients (a
tied table's included, which every round's ``embed_backward`` then adds to) accumulate
alike. With ``R = 1`` the program is the one without rounds, ids unsuffixed.

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
    #: micro-batches of the update: its rows split into ``rounds`` equal slices, each
    #: block's saved context made for one slice at a time and its gradient accumulated over
    #: them, so the rows an update takes are not bounded by what one block keeps for them
    rounds: int = attrs.field(default=1)

    @loss.validator
    def _loss(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {value!r}")

    @dtype.validator
    @moments.validator
    def _dtype(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in DTYPES:
            raise ValueError(f"{attribute.name} must be one of {', '.join(DTYPES)}, got {value!r}")

    @rounds.validator
    def _rounds(self, attribute: attrs.Attribute, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rounds must be a whole number >= 1, got {value!r}")

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

    @property
    def rounds(self) -> int:
        return self.options.rounds

    @property
    def round_rows(self) -> int:
        """The rows of one round."""
        return self.rows // self.options.rounds

    def each(self, oid: str, round_: int) -> str:
        """The id of round ``round_``'s object ``oid`` (of something that scales with the
        rows: ``h_l``, ``A_l``, ``tokens``, ...); with one round, ``oid`` itself."""
        return _each(oid, round_, self.options.rounds)

    def split(self, oid: str, tensor: Any) -> dict[str, Any]:
        """A whole-batch tensor of object ``oid`` (rows first) as every round's slice."""
        size = self.round_rows
        return {
            self.each(oid, round_): tensor[round_ * size : (round_ + 1) * size]
            for round_ in range(self.rounds)
        }

    def param_objects(self, layer: Any) -> dict[str, Any]:
        """``{object id: ParamGroup}`` of a layer's parameter groups."""
        return {param_object(layer, group): group for group in layer.groups}


def _each(oid: str, round_: int, rounds: int) -> str:
    return oid if rounds == 1 else f"{oid}_r{round_}"


#: the objects that stay whole however many rounds: the GRPO/PPO advantage normalises each
#: reward over its whole group
WHOLE = ("rewards", "groups")


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
    if rows % options.rounds:
        raise ValueError(
            f"rounds: {options.rounds} does not divide the {rows} rows (each round takes an "
            "equal slice of them)"
        )

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

    rounds = options.rounds
    per = rows // rounds  # the rows of one round

    def each(oid: str, round_: int) -> str:
        return _each(oid, round_, rounds)

    hidden = family.hidden_shape(config, per, seq)
    temps: set[int] = set()  # the blocks that keep router choices (T_l)
    for round_ in range(rounds):
        for name, kind in (("tokens", "int64"), ("targets", "int64"), ("scored", STATE)):
            add(each(name, round_), "data", kind, (per, seq))
        add(each("behaviour", round_), "data", STATE, (per, seq))
        if options.kl:
            add(each("ref", round_), "data", STATE, (per, seq))
    add("rewards", "data", STATE, (rows,))
    add("groups", "data", "int64", (rows,))
    for round_ in range(rounds):
        for index in range(count + 1):
            role = "data" if index in handed else "activation"
            add(each(f"h_{index}", round_), role, dtype, hidden)
            add(each(f"dh_{index}", round_), "grad", dtype, hidden)
        for index, block in enumerate(blocks):
            math = family.math(block.kind)
            saved = _named(math.saved(config, per, seq), dtype)
            add_packed(each(f"A_{index}", round_), "activation", saved)
            aux_temp = math.aux_temp(config, per, seq)
            if aux_temp:
                add_packed(each(f"T_{index}", round_), "aux_temp", _named(aux_temp, dtype))
                temps.add(index)
    add("stats", "output", STATE, (len(STATS),))

    rate = options.flops_per_us

    def cost(layer: Any, part: str) -> float:
        work = family.math(layer.kind).cost(config, per, seq, 4)
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

    def grads(oids: tuple[str, ...], add: bool) -> dict[str, tuple[str, ...]]:
        """A task's gradients of ``oids``: written (outputs; round 0), or added to (mutated;
        a later round, or the embedding's table after the tied head's)."""
        named = tuple("d" + oid for oid in oids)
        return {"outputs": (), "mutates": named} if add else {"outputs": named, "mutates": ()}

    def where(round_: int, **params: Any) -> dict[str, Any]:
        return params | ({"round": round_} if rounds > 1 else {})

    tied = tuple(weights(embed)) if head.tied else ()

    def head_task(round_: int) -> Task:
        # every round's scored mask: the loss weighs a token by counts over all rows
        scored = tuple(each("scored", other) for other in range(rounds))
        rollout = (each("targets", round_), *scored, each("behaviour", round_))
        rollout += (each("ref", round_),) if options.kl else ()
        written = grads((*weights(head), *tied), add=round_ > 0)
        first = round_ == 0
        return Task(
            each("head", round_),
            "head",
            "rl.head",
            params=where(round_),
            inputs=(*weights(head), *tied, each(f"h_{count}", round_), *rollout, *WHOLE),
            mutates=(*written["mutates"], *(() if first else ("stats",))),
            outputs=(
                each(f"dh_{count}", round_),
                *written["outputs"],
                *(("stats",) if first else ()),
            ),
            cost_us=cost(head, "forward"),
        )

    embed_grads = weights(embed)

    def embed_backward(round_: int) -> Task:
        # tied: the head's tasks wrote the table's gradient; every round adds to it
        written = grads(embed_grads, add=bool(tied) or round_ > 0)
        return Task(
            each("embed_backward", round_),
            "embed_backward",
            "rl.embed_backward",
            params=where(round_),
            inputs=(each("tokens", round_), each("dh_0", round_)),
            mutates=written["mutates"],
            outputs=written["outputs"],
            cost_us=1.0,
        )

    # Span by span from the last; within a span, round by round: the round's recomputes,
    # (at the last span) its head, its backwards. A block's adamw follows its last round's
    # backward, so its weights, gradient and moments are fetched once whatever the rounds,
    # and only one round's saved contexts of the span live at a time.
    tasks: list[Task] = []
    starts = sorted({0, *handed})
    spans = list(zip(starts, [*starts[1:], count], strict=True))
    for first, end in reversed(spans):
        for round_ in range(rounds):
            last = round_ == rounds - 1
            if first == 0 and 0 not in handed:
                tasks.append(
                    Task(
                        each("embed", round_),
                        "embed",
                        "rl.embed",
                        params=where(round_),
                        inputs=(*weights(embed), each("tokens", round_)),
                        outputs=(each("h_0", round_),),
                        cost_us=1.0,
                    )
                )
            for index in range(first, end):
                block = blocks[index]
                made = (each(f"T_{index}", round_),) if index in temps else ()
                following = (each(f"h_{index + 1}", round_),) if index + 1 not in handed else ()
                tasks.append(
                    Task(
                        each(f"recompute_{index}", round_),
                        "recompute",
                        "rl.recompute",
                        params=where(round_, layer=index),
                        inputs=(*weights(block), each(f"h_{index}", round_)),
                        outputs=(each(f"A_{index}", round_), *made, *following),
                        cost_us=cost(block, "forward"),
                    )
                )
            if end == count:
                tasks.append(head_task(round_))
                tasks += adamw(head) if last and not head.tied else []
            for index in reversed(range(first, end)):
                block = blocks[index]
                temp = (each(f"T_{index}", round_),) if index in temps else ()
                context = (each(f"h_{index}", round_), each(f"A_{index}", round_), *temp)
                written = grads(weights(block), add=round_ > 0)
                tasks.append(
                    Task(
                        each(f"backward_{index}", round_),
                        "backward",
                        "rl.backward",
                        params=where(round_, layer=index),
                        inputs=(*weights(block), *context, each(f"dh_{index + 1}", round_)),
                        mutates=written["mutates"],
                        outputs=(each(f"dh_{index}", round_), *written["outputs"]),
                        cost_us=cost(block, "backward"),
                    )
                )
                tasks += adamw(block) if last else []
            if first == 0:
                tasks.append(embed_backward(round_))
    tasks += adamw(embed) + (adamw(head) if head.tied else [])
    used = {oid for task in tasks for oid in task.uses}
    program = Program(
        name=f"rl-update-{family.name}",
        objects=tuple(obj for obj in objects if obj.id in used),
        tasks=tuple(tasks),
        final_locations={oid: home for oid, home in final.items() if oid in used},
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
