"""``prepare``: text -> llm.c shards, with the tokenizer saved beside them.

The text files (``scan_text``: one file, or a folder's text files in sorted order) are
tokenized one after the other (a BPE puts its end-of-text token before each file, as
llm.c's data scripts do); the first ``val_tokens`` go to ``val_000000.bin``, the rest to
``train_000001.bin``, ``train_000002.bin``... of at most ``shard_tokens`` each. Shards are
version 1 (uint16) when the vocabulary fits 65,536 ids, else version 7 (uint32).

Everything is written into a folder beside the target (``target.claim``), with
``prepared.json`` recording each shard and where in the text the next one starts, so a
killed prepare is continued (``mode="resume"``) from its last complete shard with the
tokenizer it saved first; the folder is renamed into place once complete
(``target.place``).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dataflow_feed_shards.corpus import TextScan, is_validation, scan_text
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.prepared import FORMAT, write_manifest
from dataflow_feed_shards.shard_format import VERSIONS, version_for, write_shard
from dataflow_feed_shards.target import Claim, claim, place
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
MODES = ("new", "resume", "replace")


@attrs.frozen
class Written:
    """One file ``prepare`` wrote: its path and what it holds."""

    path: Path
    what: str


@attrs.frozen
class Prepared:
    """What ``prepare`` did: the files it ``written`` (paths in ``folder``, the target),
    the shards it ``kept`` of a killed prepare it continued, and the text it read."""

    folder: Path
    written: tuple[Written, ...]
    kept: int
    scan: TextScan
    read: int  # non-empty text files read
    empty: int  # empty text files passed over
    already: bool = False  # resume of a complete dataset: nothing was done

    @property
    def shards(self) -> int:
        return self.kept + sum(item.path.suffix == ".bin" for item in self.written)


def _read_texts(files: list[Path]) -> Iterator[str]:
    for file in files:
        yield file.read_bytes().decode("utf-8", errors="replace")


class _Encoder:
    """A tokenizer: the byte one (``tokenizer`` None) or a ``tokenizers`` one."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.vocab_size, self.kind, self.end_of_text = BYTE_VOCAB, "bytes", None
        else:
            self.vocab_size, self.kind = tokenizer.get_vocab_size(), "bpe"
            self.end_of_text = tokenizer.token_to_id(END_OF_TEXT)

    @classmethod
    def named(cls, spec: str, files: list[Path]) -> _Encoder:
        """``bytes``, ``bpe:N`` (trained on ``files``) or a path to a ``tokenizer.json``."""
        if spec == "bytes":
            return cls()
        if spec.startswith("bpe:"):
            count = spec.removeprefix("bpe:")
            if not count.isdigit() or int(count) < MIN_BPE_VOCAB:
                raise FeedError(
                    f"tokenizer {spec!r}: bpe:N needs a whole N >= {MIN_BPE_VOCAB} (the 256 "
                    "bytes and the end-of-text token), e.g. bpe:4096"
                )
            return cls(train_bpe(_read_texts(files), int(count)))
        if not Path(spec).is_file():
            raise FeedError(
                f"tokenizer {spec!r} is not bytes, bpe:N or an existing tokenizer.json file"
            )
        return cls(load_tokenizer(Path(spec)))

    @classmethod
    def saved(cls, folder: Path, kind: str) -> _Encoder:
        """The tokenizer an earlier, killed prepare saved in ``folder``."""
        return cls() if kind == "bytes" else cls(load_tokenizer(folder / TOKENIZER_JSON))

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


def source_listing(text: Path, files: list[Path]) -> str:
    """A SHA-256 of the text files' paths, sizes and modification times: a continued
    prepare must read the text the killed one read."""
    base = text if text.is_dir() else text.parent
    lines = []
    for file in files:
        stat = file.stat()
        lines.append(f"{file.relative_to(base).as_posix()}\t{stat.st_size}\t{stat.st_mtime_ns}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def prepare(
    text: Path,
    tokenizer: str,
    out: Path,
    *,
    shard_tokens: int = 100_000_000,
    val_tokens: int = 0,
    mode: str = "new",
    report: Callable[[Written], None] = lambda written: None,
    say: Callable[[str], None] = lambda line: None,
) -> Prepared:
    """Tokenize the text at ``text`` with ``tokenizer`` into shards in folder ``out``.

    ``mode``: ``new`` (``out`` must be new or empty, with no killed prepare's folder
    beside it), ``resume`` (continue the killed prepare beside ``out``) or ``replace``
    (start over; the dataset at ``out`` is replaced once the new one is complete).
    ``report`` sees each file as it is written, ``say`` what was kept or removed."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if out.name in ("", ".."):  # -o . or -o ..: the folder by its own name
        out = out.resolve()
    scan = scan_text(text)
    files = [file for file in scan.files if file.stat().st_size > 0]
    if not files:
        raise FeedError(f"{text}: no non-empty text files to prepare")
    is_path = tokenizer != "bytes" and not tokenizer.startswith("bpe:")
    options = {
        "text": str(text.resolve()),
        "tokenizer": str(Path(tokenizer).resolve()) if is_path else tokenizer,
        "shard_tokens": shard_tokens,
        "val_tokens": val_tokens,
    }
    fresh = {
        "format": FORMAT,
        "complete": False,
        "target": str(out.resolve()),
        "host": socket.gethostname(),
        "options": options,
        "source": {
            "files": len(files),
            "empty": len(scan.files) - len(files),
            "skipped": scan.skipped,
            "hidden": scan.hidden,
            "listing_sha256": source_listing(text, files),
        },
        "shards": [],
    }
    claimed = claim(out, mode, fresh, say)
    done = Prepared(
        out, (), len(claimed.manifest["shards"]), scan, len(files), len(scan.files) - len(files)
    )
    if claimed.complete_already:
        return attrs.evolve(done, already=True)
    try:
        written = _write(claimed, files, tokenizer, report)
    except FeedError:
        claimed.abandon()
        raise
    place(claimed, out, say)
    return attrs.evolve(
        done, written=tuple(attrs.evolve(item, path=out / item.path.name) for item in written)
    )


def _write(
    claimed: Claim, files: list[Path], spec: str, report: Callable[[Written], None]
) -> list[Written]:
    """Write the tokenizer (unless saved already) and the shards not yet in
    ``claimed.folder``, then mark its manifest complete."""
    folder, manifest = claimed.folder, claimed.manifest
    shard_tokens, val_tokens = (manifest["options"][key] for key in ("shard_tokens", "val_tokens"))
    written: list[Written] = []

    def note(item: Written) -> None:
        written.append(item)
        report(item)

    if "tokenizer" in manifest:
        encoder = _Encoder.saved(folder, manifest["tokenizer"]["kind"])
    else:
        encoder = _Encoder.named(spec, files)
        for item in encoder.save(folder):
            note(item)
        manifest["tokenizer"] = {"kind": encoder.kind, "vocab_size": encoder.vocab_size}
        write_manifest(folder, manifest)
    version = version_for(encoder.vocab_size)
    dtype = VERSIONS[version][1]
    shards: list[dict[str, Any]] = manifest["shards"]
    trains = sum(not is_validation(shard["name"]) for shard in shards)
    start_file, start_token = shards[-1]["next"] if shards else (0, 0)
    total_tokens = sum(shard["tokens"] for shard in shards)
    pending: list[np.ndarray] = []
    pending_tokens = 0

    def wanted() -> int:  # the size of the shard being filled
        return val_tokens if val_tokens and not shards else shard_tokens

    def flush(next_file: int, next_token: int) -> None:
        nonlocal pending, pending_tokens, trains
        if val_tokens and not shards:
            name = "val_000000.bin"
        else:
            trains += 1  # train shards count from 1 (0 is the validation one), as in llm.c
            name = f"train_{trains:06d}.bin"
        tokens = np.concatenate(pending)
        write_shard(folder / name, tokens, version)
        with open(folder / name, "rb") as shard:
            digest = hashlib.file_digest(shard, "sha256").hexdigest()
        shards.append(
            {
                "name": name,
                "tokens": int(tokens.size),
                "sha256": digest,
                "next": [next_file, next_token],
            }
        )
        write_manifest(folder, manifest)
        note(Written(folder / name, f"{tokens.size} tokens, version {version} ({dtype.name})"))
        pending, pending_tokens = [], 0

    for index in range(start_file, len(files)):
        tokens = encoder.encode(files[index])
        at = start_token if index == start_file else 0
        total_tokens += tokens.size - at
        while at < tokens.size:
            take = min(tokens.size - at, wanted() - pending_tokens)
            pending.append(tokens[at : at + take])
            pending_tokens, at = pending_tokens + take, at + take
            if pending_tokens == wanted():
                flush(index, at)
    if pending_tokens and not (val_tokens and not shards):
        flush(len(files), 0)
    if not trains:
        raise FeedError(
            f"{manifest['options']['text']}: --val-tokens {val_tokens} leaves no tokens to "
            f"train on (the text has {total_tokens} tokens)"
        )
    manifest["complete"] = True
    write_manifest(folder, manifest)
    return written
