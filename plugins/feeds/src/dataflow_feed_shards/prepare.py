"""``prepare``: text -> llm.c shards, with the tokenizer saved beside them.

The text files (``text_files``: one file, or a folder's text files in sorted order) are
tokenized one after the other (a BPE puts its end-of-text token before each file, as
llm.c's data scripts do); the first ``val_tokens`` go to ``val_000000.bin``, the rest to
``train_000001.bin``, ``train_000002.bin``... of at most ``shard_tokens`` each. Shards are
version 1 (uint16) when the vocabulary fits 65,536 ids, else version 7 (uint32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dataflow_feed_shards.corpus import text_files
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.shard_format import VERSIONS, version_for, write_shard
from dataflow_feed_shards.tokenizing import (
    BYTE_VOCAB,
    END_OF_TEXT,
    TOKENIZER_JSON,
    byte_tokens,
    load_tokenizer,
    save_meta,
    train_bpe,
)

#: The smallest BPE vocabulary: the 256 bytes and the end-of-text token.
MIN_BPE_VOCAB = BYTE_VOCAB + 1


@attrs.frozen
class Written:
    """One file ``prepare`` wrote: its path and what it holds."""

    path: Path
    what: str


def _read_texts(files: list[Path]) -> Iterator[str]:
    for file in files:
        yield file.read_bytes().decode("utf-8", errors="replace")


class _Encoder:
    """One tokenizer named by ``spec``: ``bytes``, ``bpe:N`` (trained on ``files``) or a
    path to a ``tokenizer.json``."""

    def __init__(self, spec: str, files: list[Path]) -> None:
        self.tokenizer: Any = None
        if spec == "bytes":
            self.vocab_size, self.kind = BYTE_VOCAB, "bytes"
            return
        if spec.startswith("bpe:"):
            count = spec.removeprefix("bpe:")
            if not count.isdigit() or int(count) < MIN_BPE_VOCAB:
                raise FeedError(
                    f"tokenizer {spec!r}: bpe:N needs a whole N >= {MIN_BPE_VOCAB} (the 256 "
                    "bytes and the end-of-text token), e.g. bpe:4096"
                )
            self.tokenizer = train_bpe(_read_texts(files), int(count))
        else:
            path = Path(spec)
            if not path.is_file():
                raise FeedError(
                    f"tokenizer {spec!r} is not bytes, bpe:N or an existing tokenizer.json file"
                )
            self.tokenizer = load_tokenizer(path)
        self.vocab_size, self.kind = self.tokenizer.get_vocab_size(), "bpe"
        self.end_of_text = self.tokenizer.token_to_id(END_OF_TEXT)

    def encode(self, file: Path) -> np.ndarray:
        data = file.read_bytes()
        if self.tokenizer is None:
            return byte_tokens(data)
        ids = self.tokenizer.encode(data.decode("utf-8", errors="replace")).ids
        if self.end_of_text is not None:
            ids = [self.end_of_text, *ids]
        return np.asarray(ids, dtype=np.uint32)

    def save(self, out: Path) -> list[Written]:
        meta: dict[str, Any] = {"kind": self.kind}
        written = []
        if self.tokenizer is not None:
            meta["vocab_size"] = self.vocab_size
            self.tokenizer.save(str(out / TOKENIZER_JSON))
            written.append(
                Written(out / TOKENIZER_JSON, f"the tokenizer (vocab {self.vocab_size})")
            )
        written.append(Written(save_meta(out, meta), f"{self.kind}, vocab {self.vocab_size}"))
        return written


def prepare(
    text: Path,
    tokenizer: str,
    out: Path,
    *,
    shard_tokens: int = 100_000_000,
    val_tokens: int = 0,
    report: Callable[[Written], None] = lambda written: None,
) -> list[Written]:
    """Tokenize the text at ``text`` with ``tokenizer`` into shards in folder ``out``;
    ``report`` sees each file as it is written. Returns what was written."""
    files = [file for file in text_files(text) if file.stat().st_size > 0]
    if not files:
        raise FeedError(f"{text}: no non-empty text files to prepare")
    if out.is_dir() and any(out.glob("*.bin")):
        raise FeedError(f"{out}: already holds *.bin shards; write to an empty folder")
    encoder = _Encoder(tokenizer, files)
    version = version_for(encoder.vocab_size)
    dtype = VERSIONS[version][1]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Written] = []

    def emit(name: str, tokens: np.ndarray) -> None:
        write_shard(out / name, tokens, version)
        written.append(
            Written(out / name, f"{tokens.size} tokens, version {version} ({dtype.name})")
        )
        report(written[-1])

    # The validation shard is written only once training tokens follow it, so text too
    # short for both fails before anything is written.
    val, pending, pending_tokens, total_tokens, shards = None, [], 0, 0, 0
    wanted = val_tokens or shard_tokens  # the size of the shard being filled

    def flush() -> None:
        nonlocal val, pending, pending_tokens, wanted, shards
        if val_tokens and val is None:
            val = np.concatenate(pending)
        else:
            if val is not None and not written:
                emit("val_000000.bin", val)
            shards += 1  # train shards count from 1 (0 is the validation one), as in llm.c
            emit(f"train_{shards:06d}.bin", np.concatenate(pending))
        pending, pending_tokens, wanted = [], 0, shard_tokens

    for file in files:
        tokens = encoder.encode(file)
        total_tokens += tokens.size
        while tokens.size:
            take = min(tokens.size, wanted - pending_tokens)
            pending.append(tokens[:take])
            pending_tokens, tokens = pending_tokens + take, tokens[take:]
            if pending_tokens == wanted:
                flush()
    if pending_tokens:
        flush()
    if not written:
        raise FeedError(
            f"{text}: --val-tokens {val_tokens} leaves no tokens to train on (the text has "
            f"{total_tokens} tokens)"
        )
    for item in encoder.save(out):
        written.append(item)
        report(item)
    return written
