"""``TokenFeed``: the feed protocol (docs/feeds.md) over any corpus.

An epoch is one stream: the corpus's pieces concatenated in an order drawn from
``(seed, epoch)`` (each piece ranked by a SHA-256 of seed, epoch and its name, so the
order is the same on every machine and numpy version). A step reads ``world`` windows of
``batch * seq_len + 1`` tokens one after the other; rank r takes the r-th, so ranks read
disjoint tokens (a training fleet does not use this: its members all read the world-1
stream and deal its rounds, ``dataflow_training.drive.fleet``). Row b of a batch is
tokens ``b*S .. b*S+S`` of the window, its targets the same shifted by one. When the next step would run past the stream's end the epoch
goes up and the position starts at 0 of the next order (the short tail is skipped).

The position is ``(epoch, position)``: the stream offset of the next step's first token.

``next_documents`` is ``next`` with where its documents start (``dataflow train
--pack-documents``): a text or embedded corpus's files are its documents; a set of
shards' documents start at their tokenizer's ``<|endoftext|>`` (and at each shard: the
pieces of a stream are shuffled). It reads the same tokens and moves the position alike.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from dataflow_feed_shards.corpus import Corpus
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.tokenizing import END_OF_TEXT

STATE_FORMAT = "dataflow-feed/1"
#: A saved state lists every piece (name, tokens) up to this many; beyond, only a hash.
LISTED_PIECES = 64


def human_count(count: int) -> str:
    """``1234567`` -> ``1.2 M``."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(count)


class TokenFeed:
    """Endless (tokens, targets) batches of one corpus; see the module docstring."""

    def __init__(
        self,
        spec: str,
        corpus: Corpus,
        *,
        batch: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        for name, value in (("batch", batch), ("seq_len", seq_len), ("world", world)):
            if not isinstance(value, int) or value < 1:
                raise FeedError(f"{spec}: {name} must be a whole number >= 1, got {value!r}")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise FeedError(f"{spec}: rank {rank!r} is not in 0..{world - 1} (world {world})")
        self.spec, self.corpus = spec, corpus
        self.batch, self.seq_len, self.seed, self.rank, self.world = (
            batch,
            seq_len,
            int(seed),
            rank,
            world,
        )
        needed = self._step_tokens + 1
        if corpus.total_tokens < needed:
            raise FeedError(
                f"{spec}: holds {corpus.total_tokens} tokens; one step of batch {batch} x "
                f"seq_len {seq_len} x world {world} needs at least {needed}"
            )
        self._fingerprint = fingerprint(corpus)
        self._epoch, self._position = 0, 0
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self._ends = np.zeros(0, dtype=np.int64)

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    @property
    def tokenizer(self) -> Any:
        """What made the ids: ``"bytes"`` (id = byte), the absolute ``Path`` of the
        ``tokenizer.json`` saved beside the shards, or None where nothing says."""
        return self.corpus.tokenizer

    @property
    def _step_tokens(self) -> int:
        return self.world * self.batch * self.seq_len

    # -- reading -----------------------------------------------------------------------

    def _arrange(self, epoch: int) -> None:
        """The piece order of ``epoch`` and each piece's end offset in its stream."""
        if self._order_epoch == epoch:
            return
        names = self.corpus.names
        self._order = sorted(
            range(len(names)),
            key=lambda index: hashlib.sha256(
                f"{self.seed}:{epoch}:{names[index]}".encode()
            ).digest(),
        )
        self._ends = np.cumsum([self.corpus.lengths[index] for index in self._order])
        self._order_epoch = epoch

    def _read(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the current epoch's stream from offset ``start``."""
        parts, at, stop = [], start, start + count
        slot = int(np.searchsorted(self._ends, at, side="right"))
        while at < stop:
            piece_end = int(self._ends[slot])
            piece_start = piece_end - self.corpus.lengths[self._order[slot]]
            until = min(stop, piece_end)
            parts.append(self.corpus.read(self._order[slot], at - piece_start, until - piece_start))
            at, slot = until, slot + 1
        return np.concatenate(parts).astype(np.int64)

    def next(self) -> tuple[Any, Any]:
        """(tokens, targets): int64 (batch, seq_len) CPU tensors, targets shifted by one."""
        return self._next(documents=False)

    @property
    def documents(self) -> str | None:
        """What delimits this feed's documents (``next_documents``), or None where
        nothing does (bytes shards, shards of an unknown tokenizer)."""
        return self.corpus.documents

    def next_documents(self) -> tuple[Any, Any, Any]:
        """(tokens, targets, starts): ``next()``'s batch, and ``starts`` bool (batch,
        seq_len + 1), True at a token that begins a document; its last column is the
        token after the row's last (its last target). A feed whose documents nothing
        delimits (``documents`` None) refuses, naming the spec."""
        if self.documents is None:
            raise FeedError(
                f"{self.spec}: nothing marks its documents (its tokenizer, "
                f"{self.corpus.tokenizer or 'unknown'}, has no {END_OF_TEXT} token the "
                "feed knows): it cannot give where documents start"
            )
        return self._next(documents=True)

    def _next(self, documents: bool) -> tuple[Any, ...]:
        import torch

        if self._position + self._step_tokens + 1 > self.corpus.total_tokens:
            self._epoch, self._position = self._epoch + 1, 0
        self._arrange(self._epoch)
        rows = self.batch * self.seq_len
        start = self._position + self.rank * rows
        window = self._read(start, rows + 1)
        self._position += self._step_tokens
        shape = (self.batch, self.seq_len)
        batch = (
            torch.from_numpy(window[:-1].reshape(shape)),
            torch.from_numpy(window[1:].reshape(shape).copy()),
        )
        if not documents:
            return batch
        starts = self._starts(start, window)
        rows_of = np.arange(self.batch)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return (*batch, torch.from_numpy(starts[rows_of]))

    def _starts(self, start: int, window: np.ndarray) -> np.ndarray:
        """Whether each token of ``window`` (from stream offset ``start``) begins a
        document: a piece's first token, or the corpus's document token."""
        offsets = start + np.arange(window.size)
        piece_starts = np.concatenate(([0], self._ends[:-1]))
        starts = np.isin(offsets, piece_starts)
        if self.corpus.document_token is not None:
            starts |= window == self.corpus.document_token
        return starts

    # -- position ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The position as JSON-ready values; ``restore`` continues exactly from it."""
        self._arrange(self._epoch)
        slot = int(np.searchsorted(self._ends, self._position, side="right"))
        slot = min(slot, len(self._order) - 1)
        piece_start = int(self._ends[slot]) - self.corpus.lengths[self._order[slot]]
        return {
            "format": STATE_FORMAT,
            "spec": self.spec,
            "dataset": dict(self._fingerprint),
            "seed": self.seed,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "world": self.world,
            "epoch": self._epoch,
            "position": self._position,
            "shard": self.corpus.names[self._order[slot]],
            "offset": self._position - piece_start,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (of ``state()``); one of another dataset, or saved with
        another seed, batch, seq_len or world, is an error naming what differs."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise FeedError(f"{self.spec}: not a saved feed position ({STATE_FORMAT}): {state!r}")
        problem = dataset_difference(state.get("dataset"), self._fingerprint)
        if problem:
            raise FeedError(
                f"{self.spec}: the saved position is of a different dataset "
                f"({state.get('spec')}): {problem}"
            )
        for name in ("seed", "batch", "seq_len", "world"):
            if state.get(name) != getattr(self, name):
                raise FeedError(
                    f"{self.spec}: the saved position has {name} {state.get(name)!r}, this "
                    f"feed {getattr(self, name)!r}; open the feed with {name}="
                    f"{state.get(name)!r} to continue it"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)) or not (
            0 <= position <= self.corpus.total_tokens
        ):
            raise FeedError(f"{self.spec}: saved epoch {epoch!r} / position {position!r} invalid")
        self._epoch, self._position = epoch, position

    def describe(self) -> str:
        corpus = self.corpus
        return (
            f"{self.spec}, {len(corpus.names)} {corpus.kind}, "
            f"{human_count(corpus.total_tokens)} tokens, vocab {corpus.vocab_size} "
            f"({corpus.vocab_source})" + (f", {corpus.note}" if corpus.note else "")
        )


def fingerprint(corpus: Corpus) -> dict[str, Any]:
    """What identifies a corpus in a saved position: its pieces' names and sizes."""
    pieces = list(zip(corpus.names, corpus.lengths, strict=True))
    listing = "".join(f"{name}\t{length}\n" for name, length in pieces)
    found: dict[str, Any] = {
        "pieces": len(corpus.names),
        "tokens": corpus.total_tokens,
        "sha256": hashlib.sha256(listing.encode()).hexdigest()[:16],
    }
    if len(corpus.names) <= LISTED_PIECES:
        found["listing"] = [list(piece) for piece in pieces]
    return found


def dataset_difference(saved: Any, here: dict[str, Any]) -> str | None:
    """What differs between a saved fingerprint and this corpus's, or None."""
    if not isinstance(saved, dict):
        return f"no dataset fingerprint in it ({saved!r})"
    if saved.get("sha256") == here["sha256"]:
        return None
    if "listing" in saved and "listing" in here:
        before, now = dict(map(tuple, saved["listing"])), dict(map(tuple, here["listing"]))
        missing, new = sorted(before.keys() - now.keys()), sorted(now.keys() - before.keys())
        resized = [
            f"{name} holds {now[name]} tokens, {before[name]} when saved"
            for name in sorted(before.keys() & now.keys())
            if before[name] != now[name]
        ]
        parts = [f"missing here: {', '.join(missing)}"] if missing else []
        parts += [f"new here: {', '.join(new)}"] if new else []
        if parts or resized:
            return "; ".join(parts + resized)
    return (
        f"{saved.get('pieces')} pieces, {saved.get('tokens')} tokens (sha256 "
        f"{saved.get('sha256')}) when saved; {here['pieces']} pieces, {here['tokens']} tokens "
        f"(sha256 {here['sha256']}) here"
    )
