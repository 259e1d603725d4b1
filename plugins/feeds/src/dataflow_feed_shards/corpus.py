"""A corpus: named pieces of tokens in a fixed, sorted order, each read by range.

The shard feed's pieces are llm.c shards (memory-mapped); the text and embedded feeds'
pieces are text files, byte-tokenized on the fly: a file of N bytes is N tokens, so the
whole corpus is indexed from file sizes without reading it, and a batch reads only the
bytes it needs.
"""

from __future__ import annotations

import os
import sysconfig
from collections import Counter
from pathlib import Path

import attrs
import numpy as np

from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.prepared import MANIFEST, check_listing, missing_target_error
from dataflow_feed_shards.shard_format import read_shard
from dataflow_feed_shards.tokenizing import (
    BYTE_VOCAB,
    LLMC_GPT2_EOT,
    byte_tokens,
    document_token,
    saved_vocab,
)

#: What the text feed and ``data prepare`` read of a folder (recursively).
TEXT_SUFFIXES = (
    ".txt", ".md", ".rst", ".py", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".js", ".ts",
    ".java", ".html", ".css", ".json", ".toml", ".yaml", ".yml", ".csv", ".tex",
)  # fmt: skip
#: Folders of an installed Python's library that are not the standard library itself.
NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


@attrs.frozen(eq=False)  # memory maps inside: compared by identity
class Corpus:
    """Pieces (``names`` in sorted order, ``lengths`` in tokens) and how to read them."""

    kind: str  # what a piece is, for describe(): "shards" or "files"
    folder: Path  # the names are relative to it
    names: tuple[str, ...]
    lengths: tuple[int, ...]
    vocab_size: int
    vocab_source: str  # where vocab_size came from, for describe()
    tokens: tuple[np.ndarray, ...] | None = None  # the shards' memory maps; None: files
    note: str = ""  # anything else describe() says (validation shards held out)
    #: what made the ids: "bytes", the absolute path of a tokenizer.json, or None (unknown)
    tokenizer: Path | str | None = "bytes"
    #: the id that starts each document of shards (their tokenizer's ``<|endoftext|>``,
    #: or llm.c's GPT-2 one), None where nothing marks them; a file is a document
    document_token: int | None = None

    @property
    def documents(self) -> str | None:
        """What delimits the corpus's documents (``TokenFeed.next_documents``), or None
        where nothing does."""
        if self.kind == "files":
            return "each file a document"
        if self.document_token is None:
            return None
        return f"a document starts at each token {self.document_token} and at each shard"

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    def read(self, index: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of piece ``index``."""
        if self.tokens is not None:
            return self.tokens[index][start:stop]
        with open(self.folder / self.names[index], "rb") as source:
            source.seek(start)
            return byte_tokens(source.read(stop - start))


def _existing(path: Path, spec: str) -> Path:
    if not path.exists():
        raise missing_target_error(path, spec) or FeedError(f"{spec}: {path} does not exist")
    return path


def is_validation(name: str) -> bool:
    """A validation shard, by llm.c's naming: ``val`` is a word of its stem
    (``val_000000.bin``, ``fineweb_val_000000.bin``)."""
    return "val" in Path(name).stem.split("_")


def shard_corpus(location: str, split: str = "train") -> Corpus:
    """The ``*.bin`` shards of folder ``location`` (``split``: ``train``, every shard that
    is not a validation one, or ``val``), vocab from the tokenizer saved beside them."""
    spec = f"shards:{location}"
    folder = _existing(Path(location), spec)
    if not folder.is_dir():
        raise FeedError(f"{spec}: {folder} is a file; shards: takes a folder of *.bin shards")
    found = sorted(path.name for path in folder.glob("*.bin") if path.is_file())
    listed = check_listing(folder, found, spec)
    if not found:
        raise FeedError(f"{spec}: {folder} holds no *.bin shards")
    if split not in ("train", "val"):
        raise FeedError(f"{spec}: split {split!r} is not one of train, val")
    names = tuple(name for name in found if is_validation(name) == (split == "val"))
    if not names:
        raise FeedError(f"{spec}: {folder} holds no {split} shards (only {', '.join(found)})")
    tokens = tuple(read_shard(folder / name) for name in names)
    for name, shard in zip(names, tokens, strict=True):
        if listed is not None and shard.size != listed[name]:
            raise FeedError(
                f"{spec}: {folder / name} holds {shard.size} tokens, {MANIFEST} says "
                f"{listed[name]}: prepare the folder again (dataflow data prepare ... --replace)"
            )
    others = len(found) - len(names)
    other = "validation" if split == "train" else "training"
    note = f"{others} {other} shard(s) left out" if others else ""
    saved = saved_vocab(folder)
    eot = document_token(saved[2]) if saved is not None else None
    if saved is None:
        vocab_size = max((int(shard.max()) for shard in tokens if shard.size), default=-1) + 1
        saved = vocab_size, "max token id + 1 over the shards: no tokenizer saved beside them", None
        llmc_gpt2 = all(shard.dtype == np.uint16 for shard in tokens)
        eot = LLMC_GPT2_EOT if llmc_gpt2 and vocab_size == LLMC_GPT2_EOT + 1 else None
    return Corpus(
        "shards",
        folder,
        names,
        tuple(int(shard.size) for shard in tokens),
        saved[0],
        saved[1],
        tokens,
        note,
        saved[2],
        eot,
    )


@attrs.frozen
class TextScan:
    """What ``scan_text`` found: the text ``files`` (sorted), and what it passed over."""

    files: tuple[Path, ...]
    #: files of other kinds, by suffix (``""``: none), e.g. ``{".png": 3}``
    skipped: dict[str, int] = attrs.field(factory=dict)
    hidden: int = 0  # hidden files and folders, not looked into


def scan_text(path: Path) -> TextScan:
    """``path`` itself, or the text files under folder ``path`` (by ``TEXT_SUFFIXES``,
    hidden folders and files skipped), sorted by their path relative to it."""
    if path.is_file():
        return TextScan((path,))
    found, skipped, hidden = [], Counter(), 0
    for root, folders, files in os.walk(path):
        hidden += sum(name.startswith(".") for name in folders + files)
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            if name.endswith(TEXT_SUFFIXES):
                found.append(Path(root, name))
            else:
                skipped[Path(name).suffix] += 1
    found.sort(key=lambda file: file.relative_to(path).as_posix())
    return TextScan(tuple(found), dict(sorted(skipped.items())), hidden)


def text_files(path: Path) -> list[Path]:
    """The text files ``scan_text`` finds at ``path``."""
    return list(scan_text(path).files)


def _file_corpus(folder: Path, files: list[Path], spec: str) -> Corpus:
    sized = [(file, file.stat().st_size) for file in files]
    sized = [(file, size) for file, size in sized if size > 0]
    if not sized:
        raise FeedError(f"{spec}: no non-empty text files ({', '.join(TEXT_SUFFIXES)})")
    return Corpus(
        "files",
        folder,
        tuple(file.relative_to(folder).as_posix() for file, _ in sized),
        tuple(size for _, size in sized),
        BYTE_VOCAB,
        "bytes",
    )


def text_corpus(location: str) -> Corpus:
    """A text file, or the text files of a folder, byte-tokenized."""
    spec = f"text:{location}"
    path = _existing(Path(location), spec)
    files = text_files(path)
    return _file_corpus(path.parent if path.is_file() else path, files, spec)


def stdlib_corpus(location: str) -> Corpus:
    """The ``.py`` sources of this Python's standard library (``python-stdlib``)."""
    if location != "python-stdlib":
        raise FeedError(f"embedded:{location}: unknown embedded corpus; the one is python-stdlib")
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for root, folders, names in os.walk(folder):
        folders[:] = [name for name in folders if name not in NOT_STDLIB]
        files += [Path(root, name) for name in names if name.endswith(".py")]
    files.sort(key=lambda file: file.relative_to(folder).as_posix())
    return _file_corpus(folder, files, f"embedded:{location} ({folder})")
