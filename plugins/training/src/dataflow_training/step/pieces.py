"""The vocabulary tables in row pieces (``TrainConfig.vocab_pieces``).

An optimizer task holds its group's weights, gradient and optimizer state at once. For
a vocabulary table that is the step's largest moment: Qwen 3.5's 248,320 x 4,096 head is
2 GB of bf16 weights, so its update holds 8.1 GB with bf16 moments, which no 8 GiB budget
can give it and which leaves a 16 GiB one no room to stream beside it (docs/throughput.md,
session 36). With ``vocab_pieces = P`` the step stores each table in P groups of equal
rows (``vocab.0`` .. ``vocab.<P-1>``, each tensor a ``TensorSpec.piece``), so each piece
has its own ``W``, ``dW`` and ``O`` objects and its own optimizer task, and an update
holds one piece.

The embedding's and the head's tasks read every piece (they need the whole table): the
math gets them as one ``RowPieces`` value, which gathers rows from the pieces, and
``chunked_cross_entropy`` takes row pieces, each piece's matmul writing its columns of a
chunk's logits. The gradients go back piece by piece (``drive.tasks``). The model state,
checkpoints' weights and HF files hold whole tables: ``drive.values`` cuts and joins, as
it does for expert shards. The optimizer state is stored per piece; a resume in other
pieces joins it by rows and cuts it again (``drive.values.recut_opt``).

The tables are the embedding layer's first parameter (its token table: the kit's and
GPT-2's order) and every parameter of the embedding and head layers with as many rows.
Pieces need an optimizer whose update is element by element (its state the parameter's
shape: AdamW, Lion, 8-bit AdamW; not Adafactor's factored moments) and a table stored
without padding rows (``vocab_multiple`` rounds the vocabulary up: GPT-2's 50,257 is
stored as 50,304), whose rows the count divides.
"""

from __future__ import annotations

from typing import Any

import attrs

from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import FamilyContractError, LayerSpec, ParamGroup
from dataflow_training.step.optimizers import optimizer_spec

#: the group name of a table's piece ``j``: ``vocab.<j>`` (objects ``W_emb.vocab.0``, ...)
PIECE_GROUP = "vocab"


def pieced_layers(
    layers: tuple[LayerSpec, ...], train: TrainConfig, config: Any
) -> tuple[LayerSpec, ...]:
    """``layers`` (embedding first, head last) of ``config`` with their vocabulary tables
    in ``train.vocab_pieces`` row pieces (module doc); as they are with one piece. Pieces
    are refused for an optimizer whose update is not element by element."""
    pieces = train.vocab_pieces
    if pieces == 1:
        return layers
    if not optimizer_spec(train.optimizer.name).elementwise:
        raise ValueError(
            f"vocab_pieces={pieces} needs an optimizer whose update is element by element "
            "(its state shaped like the parameter, e.g. AdamW or Lion); this one's is not: "
            "use vocab_pieces=1"
        )
    embed, head = layers[0], layers[-1]
    if not embed.params:
        return layers
    rows = embed.params[0].shape[0]
    real = getattr(config, "vocab_size", rows)
    if rows != real:
        raise ValueError(
            f"vocab_pieces={pieces} needs the vocabulary stored without padding rows, but "
            f"{type(config).__name__} stores its {real:,} tokens as {rows:,} rows "
            f"(vocab_multiple={getattr(config, 'vocab_multiple', '?')}): use vocab_pieces=1"
        )
    if rows % pieces:
        raise ValueError(
            f"vocab_pieces={pieces} must divide the vocabulary's {rows:,} rows (e.g. "
            f"{', '.join(str(d) for d in divisors(rows)[:6])})"
        )
    return (_pieced(embed, rows, pieces), *layers[1:-1], _pieced(head, rows, pieces))


def _pieced(layer: LayerSpec, rows: int, pieces: int) -> LayerSpec:
    """``layer`` with each parameter of ``rows`` rows moved out of its group into
    ``pieces`` piece groups (a group left empty is dropped)."""
    groups: list[ParamGroup] = []
    tables = []
    for group in layer.groups:
        kept = [p for p in group.params if not _is_table(p, rows)]
        tables += [p for p in group.params if _is_table(p, rows)]
        if kept:
            groups.append(attrs.evolve(group, params=tuple(kept)))
    if not tables:
        return layer
    size = rows // pieces
    for j in range(pieces):
        part = tuple(attrs.evolve(p, shape=(size, *p.shape[1:]), piece=(j, pieces)) for p in tables)
        groups.append(ParamGroup(f"{PIECE_GROUP}.{j}", part))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise FamilyContractError(
            f"layer {layer.name!r}: a group named {PIECE_GROUP}.<j> is taken by the "
            "vocabulary table's pieces"
        )
    return attrs.evolve(layer, groups=tuple(groups))


def _is_table(param: Any, rows: int) -> bool:
    return len(param.shape) >= 2 and param.shape[0] == rows and param.piece is None


def divisors(n: int) -> list[int]:
    """The piece counts that divide ``n`` rows (or experts) other than 1, up to 4,096:
    what an error offers instead of a count that does not divide them."""
    return [d for d in range(2, min(n, 4096) + 1) if n % d == 0]
