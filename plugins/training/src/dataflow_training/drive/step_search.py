"""The step search of ``dataflow train`` (``plan.search``) for one run's options: what the
user pinned stays, the rest (``TrainOptions.search``) is chosen, and the options come
back with the choice in them, said in one ``search:`` line (the manifest then records
the shape, so a resumed run takes it without searching again)."""

from __future__ import annotations

import os
from typing import Any

import attrs

from dataflow import format_size
from dataflow_training.drive.checkpoint import train_dict
from dataflow_training.drive.run import resolver_for
from dataflow_training.plan.compiled_step import available_host_bytes
from dataflow_training.plan.search import Pricing, Searched, Searcher, search
from dataflow_training.plan.search_cache import SearchCache, search_key
from dataflow_training.plan.shapes import (
    Pins,
    context_length,
    published_tokens,
    resolver_options,
)

#: ``TrainOptions`` fields the search may choose (``TrainOptions.search``)
SEARCHED = (
    "batch",
    "rounds",
    "seq_len",
    "order",
    "updates",
    "tokens_per_step",
    "head_vocab_tiles",
    "resolver",
    "vocab_pieces",
    "expert_shards",  # not a field: the model override (``TrainOptions.overrides``)
)

#: The shortest sequence the search halves the context down to when it does not fit
SHORTEST_SEQ = 16

#: Set (to anything), the search cache is neither read nor written (``search_cache``)
SEARCH_CACHE_ENV = "DATAFLOW_NO_SEARCH_CACHE"

#: The machine's available memory is read to this grain (``machine_host_bytes``)
HOST_GRAIN_BYTES = 2**30


class NothingFits(ValueError):
    """No step shape runs inside the budget and the host's memory; the message is the
    one line that says what would."""


def search_for(
    o: Any, family: Any, *, host_bytes: int | None = None, pricing: Pricing | None = None
) -> tuple[Any, Searched]:
    """``o`` (``TrainOptions``) with the fields in ``o.search`` chosen, and the search.
    ``host_bytes``: the host memory the run may hold (default ``o.host_bytes``, else the
    machine's available memory); ``pricing``: how candidates are priced (default: as
    ``compile_step`` prices ``o``'s step). A sequence length not given is the preset's
    context, halved while no shape fits the budget (not where the host's memory is what
    stops them: that holds the weights and optimizer state). The search cache
    (``search_cache``; ``$DATAFLOW_NO_SEARCH_CACHE`` set: not used) gives a search made
    before of the same inputs at once. Raises ``NothingFits``."""
    free = set(o.search)
    pins = Pins(
        batch=None if "batch" in free else o.batch,
        rounds=None if "rounds" in free else o.rounds,
        order=None if "order" in free else o.order,
        updates=None if "updates" in free else o.updates,
        tokens_step=None if "tokens_per_step" in free else o.tokens_per_step,
        # a head that adds into its gradient has no float32 table for tiles to spare
        head_vocab_tiles=(
            None
            if "head_vocab_tiles" in free and o.head_accumulate != "gradient"
            else o.head_vocab_tiles
        ),
        # a pinned name checked (and "auto" read) as the run reads it
        resolver=None if "resolver" in free else resolver_for(o.resolver, o.device),
        vocab_pieces=None if "vocab_pieces" in free else o.vocab_pieces,
        expert_shards=None if "expert_shards" in free else o.overrides.get("expert_shards", 0),
    )
    config = family.config(o.preset, **o.overrides)
    if "seq_len" in free:
        seq_len = context_length(config) or 1024
        note = "the preset's context"
    else:
        seq_len, note = o.seq_len, "given"
    if host_bytes is None:
        host_bytes = o.host_bytes if o.host_bytes is not None else machine_host_bytes()
    pricing = pricing or Pricing(device=o.device, graph=o.graph, recompute=o.recompute)
    cache = None if os.environ.get(SEARCH_CACHE_ENV) else SearchCache.default()
    key = None
    if cache is not None:
        start = _unshaped(o, seq_len)
        names = [pins.resolver] if pins.resolver else resolver_options(o.device)
        identity = pricing.identity(family, names)
        if identity is not None:  # else priced by what the cache cannot name: not kept
            parts = {
                "family": o.family,
                "preset": o.preset,
                "config": repr(config),
                "step": train_dict(start.train_config(family)),
                "seq": [note, "seq_len" in free],
                "budget": o.budget_bytes,
                "backing": o.backing_bytes,
                "host": host_bytes,
                "pins": attrs.asdict(pins),
                "pricing": identity,
            }
            key = search_key(parts, family)
    kept = cache.get(key) if key is not None else None
    if kept is not None:
        return _chosen(o, kept), kept
    while True:
        shaped = _unshaped(o, seq_len)
        searcher = Searcher(
            family,
            o.preset,
            shaped.train_config(family),
            budget_bytes=o.budget_bytes,
            overrides=o.overrides,
            pricing=pricing,
            host_bytes=host_bytes,
            backing_bytes=o.backing_bytes,
        )
        cap = published_tokens(o.family, o.preset, seq_len)
        found = search(searcher, seq_len, note, pins, cap=cap, clip=o.clip)
        if found.chosen is not None or "seq_len" not in free or seq_len // 2 < SHORTEST_SEQ:
            break
        if any(t.host_bound for t in found.tried):
            break  # the host's memory holds the weights and states: a shorter one won't help
        longest = seq_len
        seq_len //= 2
        note = f"the longest that fits {_budget(o)}; the preset's {longest} does not"
    if key is not None:
        cache.put(key, found)
    if found.chosen is not None:
        searcher.keep_plan(found.chosen.shape)  # compile_step takes it, not plans it again
    return _chosen(o, found), found


def _unshaped(o: Any, seq_len: int) -> Any:
    """``o`` at ``seq_len`` with the shape the search starts from (batch 1, one round,
    round order, updates at the end): what the search cache's key and the searcher take.
    Priced without row groups (a pin the batch must honour: train_cli asks for --batch
    with --block-row-groups); the run takes the options' own."""
    return attrs.evolve(
        o, seq_len=seq_len, batch=1, rounds=1, order="round", updates="end", block_row_groups=1
    )


def machine_host_bytes() -> int | None:
    """The machine's available memory (``available_host_bytes``) rounded down to a whole
    GiB: it moves by megabytes from one run to the next, which the search cache's key
    would otherwise take for another host."""
    available = available_host_bytes()
    if available is None or available < HOST_GRAIN_BYTES:
        return available
    return available // HOST_GRAIN_BYTES * HOST_GRAIN_BYTES


def _chosen(o: Any, found: Searched) -> Any:
    """``o`` with the shape ``found`` chose (``NothingFits`` where none)."""
    if found.chosen is None:
        raise NothingFits(found.line().removeprefix("search: "))
    shape = found.chosen.shape
    return attrs.evolve(
        o,
        batch=shape.batch,
        rounds=shape.rounds,
        order=shape.order,
        updates=shape.updates,
        head_vocab_tiles=shape.head_vocab_tiles,
        vocab_pieces=shape.vocab_pieces,
        overrides=shape.overrides(o.overrides),
        resolver=shape.resolver,
        tokens_per_step=shape.tokens_step,
        seq_len=found.seq_len,
        search_slow_bytes=found.chosen.slow_budget_bytes,
        search=(),
    )


def _budget(o: Any) -> str:
    return "no budget" if o.budget_bytes is None else f"the {format_size(o.budget_bytes)} budget"
