"""The candidates of the step search (``plan.search``): a **shape** is what ``dataflow
train`` can choose without changing what is learnt per token (the tokens per optimizer
step split into ``batch`` x ``rounds``, the task order, where the updates run, the head
by vocabulary tiles, the pieces of the vocabulary tables and of the experts, the
resolver), ``Pins`` what the user fixed, ``shapes`` every candidate they leave, and the
defaults a search starts from: the preset's context (``context_length``) and its
published tokens per step (``published_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from dataflow import resolvers
from dataflow_training.plan.predict import MAX_SEQ_LEN_FIELDS
from dataflow_training.step.config import TrainConfig, parse_order

#: Tokens per optimizer step a paper states for a preset's model (family -> (tokens,
#: source)); ``published_tokens`` says the rule for the others
PUBLISHED_TOKENS = {
    "gpt2": (512 * 1024, "GPT-2's 512 x 1,024 tokens (Radford et al. 2019)"),
    "llama3": (4 * 2**20, "Llama 2's 4M tokens at every size (Touvron et al. 2023)"),
}

#: The rule for a ``*_tiny`` demo preset (no paper): this many sequences of its context,
#: gpt2_tiny's 512 tokens (the 8 x 64 of ``dataflow train`` before the search), so the
#: README's main job keeps its length on a CPU
TINY_SEQUENCES = 4

#: The rule for any other preset with no published batch: GPT-2's 0.5M tokens
UNPUBLISHED_TOKENS = 2**19

#: Orders ``layer:K`` tried, K below the step's rounds
GROUPS = (2, 4, 8, 16)

#: The most accumulation rounds a searched step has (a plan's time grows faster than its
#: tasks: on a CPU core Llama 3 8B's 16-round step plans in about 7 s by round, its
#: 32-round step in about 47 s by layer); compare.py's fastest rows use 16 (Llama 3 8B)
#: and 32 (GPT-2 124M, whose rounds plan in well under a second)
MAX_ROUNDS = 16


def published_tokens(family_name: str, preset: str, seq_len: int) -> tuple[int, str]:
    """The cap on the default tokens per step and where it comes from: the preset's
    published batch (``PUBLISHED_TOKENS``), ``TINY_SEQUENCES`` sequences for a tiny demo
    preset, else ``UNPUBLISHED_TOKENS`` (at least one sequence)."""
    if preset.endswith("_tiny"):
        return TINY_SEQUENCES * seq_len, f"a demo preset: {TINY_SEQUENCES} sequences"
    if family_name in PUBLISHED_TOKENS:
        return PUBLISHED_TOKENS[family_name]
    tokens = max(seq_len, UNPUBLISHED_TOKENS // seq_len * seq_len)
    return tokens, "no published batch: GPT-2's 0.5M tokens"


def context_length(config: Any) -> int | None:
    """The longest sequence the model was trained at: the rope scaling's original
    context where the config has one (Llama 3.1 8B: 8,192; its 131,072 positions come
    from a long-context extension), else the first of ``MAX_SEQ_LEN_FIELDS`` it sets."""
    scaling = getattr(config, "rope_scaling", None)
    original = getattr(scaling, "original_max_position", None)
    longest = [getattr(config, field, None) for field in MAX_SEQ_LEN_FIELDS]
    longest = [n for n in longest if isinstance(n, int)]
    if isinstance(original, int) and (not longest or original <= longest[0]):
        return original
    return longest[0] if longest else None


@attrs.frozen
class Pins:
    """The choices the user made (None: the search's): ``batch``, ``rounds``, ``order``,
    ``updates``, ``tokens_step``, ``head_vocab_tiles``, ``resolver``, ``vocab_pieces``,
    ``expert_shards``."""

    batch: int | None = None
    rounds: int | None = None
    order: str | None = None
    updates: str | None = None
    tokens_step: int | None = None
    head_vocab_tiles: bool | None = None
    resolver: str | None = None
    vocab_pieces: int | None = None
    expert_shards: int | None = None


@attrs.frozen(order=True)
class Shape:
    """One candidate (module docstring); ordered by tokens per step, then the rest, so
    that ties go the same way every time."""

    tokens_step: int
    batch: int
    rounds: int
    order: str
    updates: str
    head_vocab_tiles: bool
    resolver: str
    #: ``TrainConfig.vocab_pieces``: chosen for every candidate alike (``plan.search``)
    vocab_pieces: int = 1
    #: the model config's ``expert_shards`` (``kit.moe.expert_shards``), a model override;
    #: 0: the config's own (chosen as ``vocab_pieces`` is)
    expert_shards: int = 0

    def train(self, base: TrainConfig) -> TrainConfig:
        return attrs.evolve(
            base,
            batch=self.batch,
            rounds=self.rounds,
            order=self.order,
            updates=self.updates,
            head_vocab_tiles=self.head_vocab_tiles,
            vocab_pieces=self.vocab_pieces,
        )

    def overrides(self, base: dict[str, Any]) -> dict[str, Any]:
        """The model overrides of ``shape``'s step: ``base``, with ``expert_shards``."""
        return base | {"expert_shards": self.expert_shards} if self.expert_shards else base

    def text(self) -> str:
        tiles = ", head by vocab tiles" if self.head_vocab_tiles else ""
        if self.vocab_pieces > 1:
            tiles += f", vocab in {self.vocab_pieces} pieces"
        if self.expert_shards:
            tiles += f", experts in {self.expert_shards} shards"
        return (
            f"batch {self.batch} x {self.rounds} rounds ({self.tokens_step:,} tokens/step), "
            f"order {self.order}, updates {self.updates}{tiles}, resolver {self.resolver}"
        )

    def fields(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @property
    def live_sequences(self) -> int:
        """Sequences whose saved context a step holds at once at most: a round's (round
        order), a group's of ``K`` rounds (``layer:K``) or every round's (``layer``). The
        host memory a plan needs grows with it: whatever the fast budget cannot hold,
        offloaded or recomputed, leaves at least each block's input behind."""
        kind, group = parse_order(self.order)
        if kind == "round":
            return self.batch
        return self.batch * min(group or self.rounds, self.rounds)


def resolver_options(device: str) -> list[str]:
    """The resolvers the search tries on ``device``: on CUDA the compiled one (where
    installed) and eager torch; elsewhere eager torch (compiling a CPU step's tasks takes
    longer than its steps)."""
    known = {spec.name for spec in resolvers()}
    if device.startswith("cuda") and "torch-compiled" in known:
        return ["torch-compiled", "torch"]
    return ["torch"]


def shapes(
    seq_len: int,
    token_options: Iterable[int],
    pins: Pins,
    *,
    clip: float | None,
    tiles: bool,
    resolver_names: list[str],
    streams: bool = True,
    pieces: tuple[int, int] = (1, 0),
) -> list[Shape]:
    """Every candidate for the tokens-per-step options, honouring ``pins``: batches of
    powers of two (or the pinned batch or rounds), the orders ``round``, ``layer`` and
    ``layer:K`` (K in ``GROUPS`` below the rounds) where the persistent objects do not fit
    the budget (``streams``: else nothing streams, and layer order only holds more
    activations), early and end updates (end alone with ``clip``), the head by vocabulary
    tiles where ``tiles``; at most ``MAX_ROUNDS`` rounds unless pinned; every one with
    ``pieces``: (``vocab_pieces``, ``expert_shards``)."""
    found = []
    for tokens in token_options:
        sequences = tokens // seq_len
        if sequences < 1 or sequences * seq_len != tokens:
            continue
        for batch in _batches(sequences, pins):
            rounds = sequences // batch
            if rounds > MAX_ROUNDS and pins.rounds is None:
                continue
            if pins.order is not None:
                orders = [pins.order]
            else:
                orders = ["round"]
                if rounds > 1 and streams:
                    orders += ["layer", *(f"layer:{k}" for k in GROUPS if k < rounds)]
            updates = [pins.updates] if pins.updates else (["end"] if clip else ["end", "early"])
            tile = [pins.head_vocab_tiles] if pins.head_vocab_tiles is not None else [False]
            if pins.head_vocab_tiles is None and tiles:
                tile.append(True)
            for order in orders:
                for update in updates:
                    if update == "auto":  # what auto means for this order
                        grouped = parse_order(order)[0] == "layer" and rounds > 1
                        update = "early" if grouped and not clip else "end"
                    for tiled in tile:
                        for name in resolver_names:
                            shape = Shape(
                                tokens, batch, rounds, order, update, tiled, name, *pieces
                            )
                            found.append(shape)
    return sorted(set(found))


def _batches(sequences: int, pins: Pins) -> list[int]:
    if pins.batch is not None:
        return [pins.batch] if sequences % pins.batch == 0 else []
    if pins.rounds is not None:
        return [sequences // pins.rounds] if sequences % pins.rounds == 0 else []
    return [b for b in (2**k for k in range(sequences.bit_length())) if sequences % b == 0]


def token_options(seq_len: int, pins: Pins, cap: int) -> list[int]:
    """Tokens per step to try: the pinned figure, the one the pinned batch and rounds
    make, else a power of two times the sequences the pinned batch (or rounds) makes,
    up to ``cap`` (at least once)."""
    if pins.tokens_step is not None:
        return [pins.tokens_step]
    if pins.batch is not None and pins.rounds is not None:
        return [pins.batch * pins.rounds * seq_len]
    unit = seq_len * (pins.batch or pins.rounds or 1)
    times = max(1, cap // unit)
    return [unit * 2**k for k in range(times.bit_length())]


def same_tasks(shape: Shape, rounds: int) -> Shape:
    """A shape with ``shape``'s tasks for ``rounds`` rounds (round order, end updates:
    the order and the updates' place move tasks, they add none)."""
    return attrs.evolve(shape, tokens_step=0, rounds=rounds, order="round", updates="end")
