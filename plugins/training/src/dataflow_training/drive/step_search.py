"""The step search of ``dataflow train`` (``plan.search``) for one run's options: what the
user pinned stays, the rest (``TrainOptions.search``) is chosen, and the options come
back with the choice in them, said in one ``search:`` line (the manifest then records
the shape, so a resumed run takes it without searching again)."""

from __future__ import annotations

from typing import Any

import attrs

from dataflow import format_size
from dataflow_training.drive.run import resolver_for
from dataflow_training.plan.compiled_step import available_host_bytes
from dataflow_training.plan.search import Pricing, Searched, Searcher, search
from dataflow_training.plan.shapes import Pins, context_length, published_tokens

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
)

#: The shortest sequence the search halves the context down to when it does not fit
SHORTEST_SEQ = 16


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
    stops them: that holds the weights and optimizer state). Raises ``NothingFits``."""
    free = set(o.search)
    pins = Pins(
        batch=None if "batch" in free else o.batch,
        rounds=None if "rounds" in free else o.rounds,
        order=None if "order" in free else o.order,
        updates=None if "updates" in free else o.updates,
        tokens_step=None if "tokens_per_step" in free else o.tokens_per_step,
        head_vocab_tiles=None if "head_vocab_tiles" in free else o.head_vocab_tiles,
        # a pinned name checked (and "auto" read) as the run reads it
        resolver=None if "resolver" in free else resolver_for(o.resolver, o.device),
    )
    config = family.config(o.preset, **o.overrides)
    if "seq_len" in free:
        seq_len = context_length(config) or 1024
        note = "the preset's context"
    else:
        seq_len, note = o.seq_len, "given"
    if host_bytes is None:
        host_bytes = o.host_bytes if o.host_bytes is not None else available_host_bytes()
    pricing = pricing or Pricing(device=o.device, graph=o.graph, recompute=o.recompute)
    while True:
        shaped = attrs.evolve(o, seq_len=seq_len, batch=1, rounds=1, order="round", updates="end")
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
    if found.chosen is None:
        raise NothingFits(found.nothing_fits)
    shape = found.chosen.shape
    searcher.keep_plan(shape)  # compile_step takes it rather than plan it again
    chosen = attrs.evolve(
        o,
        seq_len=seq_len,
        batch=shape.batch,
        rounds=shape.rounds,
        order=shape.order,
        updates=shape.updates,
        head_vocab_tiles=shape.head_vocab_tiles,
        resolver=shape.resolver,
        tokens_per_step=shape.tokens_step,
        search_slow_bytes=found.chosen.slow_budget_bytes,
        search=(),
    )
    return chosen, found


def _budget(o: Any) -> str:
    return "no budget" if o.budget_bytes is None else f"the {format_size(o.budget_bytes)} budget"
