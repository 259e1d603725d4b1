"""What a training step is: sequence length, batch, accumulation rounds, dtypes, optimizer."""

from __future__ import annotations

from typing import Any

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from dataflow import DTYPE_BYTES
from dataflow_training.step.lora import LoraConfig


def _dtype(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in DTYPE_BYTES:
        raise ValueError(f"{attribute.name}: {value!r} is not one of {sorted(DTYPE_BYTES)}")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def _clip(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"clip must be > 0 (or None for no clipping), got {value}")


@attrs.frozen
class DtypePolicy:
    """Storage dtypes: ``param`` for weights (and the compute of their layer), ``grad`` for
    weight gradients (accumulated across rounds in this dtype), ``activation`` for hidden
    states and saved activations."""

    param: str = attrs.field(default="float32", validator=_dtype)
    grad: str = attrs.field(default="float32", validator=_dtype)
    activation: str = attrs.field(default="float32", validator=_dtype)

    @classmethod
    def named(cls, name: str) -> DtypePolicy:
        """``fp32`` (everything float32) or ``bf16`` (everything bfloat16)."""
        policies = {"fp32": cls(), "bf16": cls("bfloat16", "bfloat16", "bfloat16")}
        try:
            return policies[name]
        except KeyError:
            raise ValueError(f"unknown dtype policy {name!r}; known: {sorted(policies)}") from None


@attrs.frozen
class OptimizerPolicy:
    """The optimizer (default AdamW; decoupled weight decay, off for parameters a family
    marks ``decay=False``).

    ``name`` selects a registered optimizer (the ``dataflow_optimizers`` hook;
    ``step.optimizers``), each with its own state fields: ``state_dtypes`` gives the dtype
    of exactly those fields (AdamW's ``exp_avg``, ``exp_avg_sq``). ``args`` holds the
    arguments given for it (``--optimizer-arg``, typed by its spec); the rest take the
    spec's defaults (``step.optimizers.hyperparameters``).
    """

    name: str = "adamw"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    state_dtypes: dict[str, str] = attrs.field(
        factory=lambda: {"exp_avg": "float32", "exp_avg_sq": "float32"}, hash=False
    )
    args: dict[str, Any] = attrs.field(factory=dict, hash=False)


#: ``--optimizer-states`` names -> the dtype of the optimizer's state fields
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
#: ``--optimizer-states int8``: AdamW's moments block-wise in 8 bits (``optim.blockwise8``),
#: the update ``adamw_int8``'s fields -> their dtypes (codes; float32 scales, one a block)
INT8_STATES = {
    "exp_avg": "int8",
    "exp_avg_sq": "uint8",
    "exp_avg_scale": "float32",
    "exp_avg_sq_scale": "float32",
}
#: everything ``--optimizer-states`` takes
STATE_CHOICES = (*STATE_DTYPES, "int8")


def optimizer_states(name: str, **fields: Any) -> OptimizerPolicy:
    """AdamW (``OptimizerPolicy(**fields)``) with both moments kept in ``name``'s dtype
    (``STATE_DTYPES``): ``bf16`` halves their memory and their traffic over the host link
    (what the throughput rows of docs/throughput.md use, as stock PyTorch does with bf16
    parameters), ``fp32`` keeps them exact; ``int8`` keeps them block-wise quantized
    (``INT8_STATES``, the update ``adamw_int8``), about a quarter of float32's bytes. An
    unknown name is a ValueError naming the known ones."""
    if name == "int8":
        return OptimizerPolicy(name="adamw_int8", state_dtypes=dict(INT8_STATES), **fields)
    if name not in STATE_DTYPES:
        raise ValueError(f"optimizer states {name!r}: one of {', '.join(STATE_CHOICES)}")
    dtype = STATE_DTYPES[name]
    return OptimizerPolicy(**fields, state_dtypes={"exp_avg": dtype, "exp_avg_sq": dtype})


#: Bytes of head workspace per logit of a chunk (16-bit logits, a float32 copy of them on
#: the torch path, and the 16-bit gradient written over them): what ``head_chunk_tokens``
#: sizes a chunk by.
HEAD_BYTES_PER_LOGIT = 6


def head_chunk_tokens(budget_bytes: int, vocab: int, largest: int = 8192) -> int:
    """The head's token chunk for a fast budget: the largest power of two up to
    ``largest`` whose logits workspace (chunk x vocab x ``HEAD_BYTES_PER_LOGIT``) takes at
    most a quarter of the budget (at least 16 tokens). A larger chunk is a larger matmul
    but its workspace sits beside the arena, taking room from the plan."""
    chunk = largest
    while chunk > 16 and chunk * vocab * HEAD_BYTES_PER_LOGIT > budget_bytes // 4:
        chunk //= 2
    return chunk


#: ``TrainConfig.order``'s kinds (``"layer:K"`` is layer order in groups of K rounds).
ORDERS = ("round", "layer")
#: What ``parse_order`` takes, for help texts and errors.
ORDER_FORMS = "round, layer or layer:K (K rounds a group, K >= 1)"


def parse_order(text: str) -> tuple[str, int | None]:
    """``TrainConfig.order`` as (kind, rounds a group): ``"round"`` -> ("round", None),
    ``"layer"`` -> ("layer", None: every round in one group), ``"layer:K"`` ->
    ("layer", K). ValueError names the text otherwise."""
    kind, colon, group = str(text).partition(":")
    if kind in ORDERS and not colon:
        return kind, None
    if kind == "layer" and group.isdigit() and int(group) >= 1:
        return kind, int(group)
    raise ValueError(f"order {text!r}: one of {ORDER_FORMS}")


def _order(instance: object, attribute: attrs.Attribute, value: str) -> None:
    parse_order(value)


#: ``TrainConfig.updates``' values
UPDATES = ("auto", "early", "end")


def _updates(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in UPDATES:
        raise ValueError(f"updates must be one of {', '.join(UPDATES)}, got {value!r}")
    if value == "early" and instance.clip is not None:
        raise ValueError(
            "updates='early' cannot clip: every update reads the step's global gradient "
            "norm, known only after the last gradient (use updates='end' or 'auto')"
        )


def _head_accumulate(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value not in ("float32", "gradient"):
        raise ValueError(f"head_accumulate must be 'float32' or 'gradient', got {value!r}")


@attrs.frozen
class TrainConfig:
    """One training step: ``rounds`` micro-batches of ``batch`` x ``seq_len`` tokens whose
    gradients accumulate, then one optimizer update. ``chunk_tokens`` bounds the head's
    logits to chunk_tokens x vocab at a time. ``head_vocab_tiles`` makes the head's weight
    gradient one vocabulary tile at a time instead of summing it over the chunks in a
    float32 (vocab, dim) table: that table leaves the head's workspace (2.1 GB for Llama
    3's 128,256 x 4,096 head, set aside beside the arena for the whole step), for one more
    logits matmul (a third more head compute). For a large vocabulary in a small budget.

    ``clip`` is the largest global gradient norm (over every trainable tensor) the update
    sees: every gradient is scaled by ``min(1, clip / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does; None turns clipping off. ``grad_norm`` asks
    for the global norm to be measured even without clipping (a ``gnorm`` task per
    parameter group; the driver reads it back for its logs).

    ``order`` is the chain's task order over rounds and layers (the same tasks and the
    same arithmetic either way: each gradient accumulates over the rounds in round order):

    - ``"round"``: each round runs forward through every layer and back before the next
      round starts. One round's activations are alive at a time, but every layer's weights
      are read once per round in forward and once in backward, and a gradient too large
      to stay resident crosses the link twice a round to accumulate.
    - ``"layer"``: every round runs through one layer before the next layer (forward from
      the embedding up, then backward from the last block down). Each layer's weights are
      read once for the step's forwards and once for its backwards, and its gradient
      accumulates over all rounds in one stretch; in exchange every round's hidden state
      at a layer boundary is alive at once, and every round's saved activations wait for
      the backward (the planner offloads them or the recompute planner re-derives them).
      The order for a model whose weights do not fit the budget.
    - ``"layer:K"``: layer order within groups of K consecutive rounds, one group after
      another (the last group may be smaller): weights cross the link once a group each
      way, and only a group's activations wait for its backward. Between the two: K = 1
      is round order's chain, K >= rounds layer order's. The order for a model whose
      rounds' activations, all kept, would not fit the host.

    ``updates`` places the optimizer's updates in the chain: ``"end"`` after every
    backward; ``"early"`` each right after the last task that touches its group's weights
    or gradient (its layer's last-round backward), where those are still in fast memory
    and the update, its optimizer state's transfers included, runs while the layers below
    run backward (not with ``clip``, which every update waits for; a data-parallel
    all-reduce keeps them at the end too); ``"auto"`` is ``"early"`` in layer orders and
    ``"end"`` in round order. Planned on the CPU with session 19's H200 task profiles
    (``benchmarks/place_llama3_8b.py``), early updates took OLMoE 1B-7B at 16 GiB by
    layer from 6.29 to 5.53 s a step, Llama 3 8B at 8 GiB (layer:8) from 14.44 to 13.47 s
    and at 16 GiB by round from 13.73 to 13.08 s, Llama 3.2 1B at 4 GiB by layer from
    2.64 to 2.49 s, while GPT-2 124M by round moved little (2 GiB 1.195 to 1.191 s, 1 GiB
    1.329 to 1.333 s: the updates' optimizer state in fast memory beside the last round's
    activations costs recompute at small budgets).

    ``freeze``: patterns naming the parameters that do not train (``step.freezing``:
    ``embed``, ``head``, ``layers.0-11``, globs over ``<layer>.<param>``); the lowering
    gives them no gradient or optimizer state and prunes the backward below the lowest
    layer that trains.

    ``lora`` (``step.lora.LoraConfig``, None: off): adapters on the target linears of
    every block, the only parameters that train; the base is frozen.

    ``segments``: every round carries a ``kit.Segments`` beside its tokens (object
    ``S_s_r``: which sequence each token belongs to, -1 for padding, and its rotary
    position), read by every block task whose attention takes it: padded batches and
    rows packed with several documents (``dataflow train --pack-documents``). A family
    whose attention (or embedding) takes no segments refuses it at lowering. Off, the
    step is what it was before the field existed, byte for byte.

    ``vocab_pieces``: the vocabulary tables (the embedding's token table and an untied
    head's projection) stored and updated in that many equal row pieces, each a parameter
    group of its own (``step.pieces``): an update holds one piece's weights, gradient and
    optimizer state instead of the whole table's (Qwen 3.5's 248,320 x 4,096 head: 8.1 GB
    at once in bf16), so a small budget can hold it and the planner can stream around it.
    1 (the default) stores them whole, as before the field existed.

    ``head_accumulate``: how the head sums its projection's gradient over a round's
    chunks. ``"float32"`` (the default): in a float32 (vocab, dim) table, rounded once a
    round into the 16-bit gradient (4.1 GB of workspace for Qwen 3.5's head).
    ``"gradient"``: each chunk's product added straight into the 16-bit gradient object
    (in the matmul, scaled first), so no such table exists: a rounding a chunk instead of
    one a round, for a head whose workspace bounds a small budget. Only with 16-bit
    weights, an untied head and no ``head_vocab_tiles``.

    ``block_row_groups``: each block task (forward, recompute, backward) runs its math
    over the round's sequences in that many groups, one after the other, each group's
    gradients added into the block's as a round's are: the same work, about 1/N of the
    task's workspace (Qwen 3.5's linear block's backward holds 3.8 GB at batch 4), the
    gradients rounded once more a group. It must divide ``batch``. 1 (the default) runs
    the whole batch at once. Refused for blocks with routing, Aux or another layer's
    objects, with segments and with LoRA (the lowering says which)."""

    seq_len: int = attrs.field(validator=_positive)
    batch: int = attrs.field(default=1, validator=_positive)
    rounds: int = attrs.field(default=1, validator=_positive)
    dtype: DtypePolicy = attrs.field(factory=DtypePolicy)
    optimizer: OptimizerPolicy = attrs.field(factory=OptimizerPolicy)
    chunk_tokens: int = attrs.field(default=1024, validator=_positive)
    head_vocab_tiles: bool = False
    clip: float | None = attrs.field(default=None, validator=_clip)
    grad_norm: bool = False
    order: str = attrs.field(default="round", validator=_order)
    updates: str = attrs.field(default="auto", validator=_updates)
    freeze: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    lora: LoraConfig | None = None
    segments: bool = False
    vocab_pieces: int = attrs.field(default=1, validator=_positive)
    head_accumulate: str = attrs.field(default="float32", validator=_head_accumulate)
    block_row_groups: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.batch % self.block_row_groups:
            raise ValueError(
                f"block_row_groups={self.block_row_groups} (--block-row-groups) must divide "
                f"batch={self.batch}"
            )
        if self.head_accumulate == "gradient" and self.head_vocab_tiles:
            raise ValueError(
                "head_accumulate='gradient' cannot go with head_vocab_tiles: the tiles make "
                "the head's gradient tile by tile, with no float32 table to spare"
            )

    @property
    def order_group(self) -> int:
        """The rounds that go through the layers together (``order``): 1 in round order,
        every round in plain layer order."""
        kind, group = parse_order(self.order)
        if kind == "round":
            return 1
        return min(group or self.rounds, self.rounds)

    @property
    def early_updates(self) -> bool:
        """Whether each update follows its group's last use (``updates``)."""
        if self.updates == "auto":
            return self.order_group > 1 and self.clip is None
        return self.updates == "early"

    @property
    def measures_grad_norm(self) -> bool:
        """Whether the lowered step has ``gnorm`` tasks."""
        return self.grad_norm or self.clip is not None

    @property
    def tokens_per_round(self) -> int:
        return self.batch * self.seq_len


#: the fields ``omit_empty_freeze`` leaves out of a written TrainConfig at these values
#: (what a comparison of two written configs fills in: ``drive.run``'s restore)
OMITTED_DEFAULTS = {
    "freeze": [],
    "lora": None,
    "segments": False,
    "vocab_pieces": 1,
    "head_accumulate": "float32",
    "block_row_groups": 1,
}


def omit_empty_freeze(converter: Any) -> None:
    """Have ``converter`` (a ``cattrs.Converter``) write a TrainConfig that freezes nothing
    (and has no ``lora``, no ``segments``, whole vocabulary tables) as before ``freeze`` existed: its programs hash the same and its checkpoints match
    those of older runs."""
    converter.register_unstructure_hook(
        TrainConfig,
        make_dict_unstructure_fn(
            TrainConfig,
            converter,
            freeze=override(omit_if_default=True),
            lora=override(omit_if_default=True),
            segments=override(omit_if_default=True),
            vocab_pieces=override(omit_if_default=True),
            head_accumulate=override(omit_if_default=True),
            block_row_groups=override(omit_if_default=True),
        ),
    )
    # a LoRA run with its base in the run's dtype is written as before --lora-base
    converter.register_unstructure_hook(
        LoraConfig,
        make_dict_unstructure_fn(LoraConfig, converter, base=override(omit_if_default=True)),
    )
