"""Tokenizers a feed or ``data prepare`` uses, and the one saved beside a set of shards.

Beside the shards lies ``tokenizer_meta.json`` (``{"kind": "bytes"}`` or
``{"kind": "bpe", "vocab_size": N}``) and, for a BPE, the ``tokenizer.json`` of the
``tokenizers`` library. ``saved_vocab`` reads the vocabulary size from either (the small
meta file first, so opening a feed need not load the tokenizer), and which tokenizer made
the ids: ``"bytes"``, the ``tokenizer.json`` file, or None where the folder does not say.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dataflow_feed_shards.errors import FeedError

META = "tokenizer_meta.json"
TOKENIZER_JSON = "tokenizer.json"
BYTE_VOCAB = 256
#: The document separator a BPE learns as a special token (id 0 when trained here).
END_OF_TEXT = "<|endoftext|>"
#: llm.c's GPT-2 shards (version 1, no tokenizer saved beside them) start every document
#: with GPT-2's ``<|endoftext|>``, the last of its 50,257 ids
LLMC_GPT2_EOT = 50256


def byte_tokens(data: bytes) -> np.ndarray:
    """The byte tokenizer: one token per byte, ids 0..255."""
    return np.frombuffer(data, dtype=np.uint8)


def saved_vocab(folder: Path) -> tuple[int, str, Path | str | None] | None:
    """(vocab_size, where it came from, the tokenizer: ``"bytes"``, the absolute path of
    its ``tokenizer.json`` or None) of the tokenizer saved in ``folder``, or None."""
    meta_path, json_path = folder / META, folder / TOKENIZER_JSON
    tokenizer = json_path.resolve() if json_path.is_file() else None
    if meta_path.is_file():
        meta = _read_json(meta_path)
        kind = meta.get("kind") if isinstance(meta, dict) else None
        if kind == "bytes":
            return BYTE_VOCAB, f"{META}: bytes", "bytes"
        vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
        if kind == "bpe" and isinstance(vocab_size, int) and vocab_size > 0:
            return vocab_size, f"{META}: bpe", tokenizer
        raise FeedError(
            f'{meta_path}: expected {{"kind": "bytes"}} or {{"kind": "bpe", "vocab_size": N}}, '
            f"got {json.dumps(meta)}"
        )
    if json_path.is_file():
        return load_tokenizer(json_path).get_vocab_size(), TOKENIZER_JSON, tokenizer
    return None


def document_token(tokenizer: Path | str | None) -> int | None:
    """The id that starts each document in shards made with ``tokenizer`` (a
    ``tokenizer.json``: its ``<|endoftext|>``, which ``data prepare`` puts before every
    file), or None: bytes mark no documents, and an unknown tokenizer says nothing."""
    if not isinstance(tokenizer, Path):
        return None
    return load_tokenizer(tokenizer).token_to_id(END_OF_TEXT)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeedError(f"{path}: not readable JSON ({exc})") from None


def load_tokenizer(path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises bare Exceptions for a bad file
        raise FeedError(
            f"{path}: not a tokenizer.json the tokenizers library reads ({exc})"
        ) from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens learnt from ``texts``: the 256 bytes, the
    end-of-text token, then merges (fewer when the text has too few pairs to merge)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_meta(folder: Path, meta: dict[str, Any]) -> Path:
    path = folder / META
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path
