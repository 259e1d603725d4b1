"""The ``open`` of each scheme: a location and the protocol's options -> a ``TokenFeed``.

``batch`` and ``seq_len`` default to a small batch so ``open(location)`` alone works (the
conformance tests open each feed that way); the training driver always passes them.
"""

from __future__ import annotations

from dataflow_feed_shards.corpus import shard_corpus, stdlib_corpus, text_corpus
from dataflow_feed_shards.feed import TokenFeed

DEFAULT_BATCH, DEFAULT_SEQ_LEN = 4, 64


def open_shards(
    location: str,
    *,
    batch: int = DEFAULT_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    split: str = "train",
) -> TokenFeed:
    """``shards:DIR``: the folder's llm.c shards (``split="val"``: its validation ones)."""
    spec = f"shards:{location}" if split == "train" else f"shards:{location} ({split})"
    corpus = shard_corpus(location, split)
    return TokenFeed(spec, corpus, batch=batch, seq_len=seq_len, seed=seed, rank=rank, world=world)


def open_text(
    location: str,
    *,
    batch: int = DEFAULT_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
) -> TokenFeed:
    """``text:PATH``: a text file or a folder of them, byte-tokenized on the fly."""
    return TokenFeed(
        f"text:{location}",
        text_corpus(location),
        batch=batch,
        seq_len=seq_len,
        seed=seed,
        rank=rank,
        world=world,
    )


def open_embedded(
    location: str = "python-stdlib",
    *,
    batch: int = DEFAULT_BATCH,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
) -> TokenFeed:
    """``embedded:python-stdlib``: this Python's standard library sources, byte-tokenized."""
    return TokenFeed(
        f"embedded:{location}",
        stdlib_corpus(location),
        batch=batch,
        seq_len=seq_len,
        seed=seed,
        rank=rank,
        world=world,
    )
