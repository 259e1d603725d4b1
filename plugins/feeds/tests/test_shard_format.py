"""The llm.c shard format: round trips of both versions, every corrupt case named, and
what a folder of shards must hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from dataflow_feed_shards.corpus import shard_corpus
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.opening import open_shards
from dataflow_feed_shards.shard_format import HEADER_BYTES, read_header, read_shard, write_shard


@pytest.mark.parametrize(
    ("version", "magic", "dtype", "top"),
    [(1, 20240520, "<u2", 65535), (7, 20240801, "<u4", 4_000_000_000)],
)
def test_round_trip(tmp_path: Path, version: int, magic: int, dtype: str, top: int) -> None:
    tokens = np.array([0, 1, 2, top, 7, top - 1], dtype=np.int64)
    path = tmp_path / "one.bin"
    write_shard(path, tokens, version)
    raw = path.read_bytes()  # read back by hand, not through the reader under test
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert list(header[:3]) == [magic, version, tokens.size] and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[HEADER_BYTES:], dtype=dtype), tokens)
    assert read_header(path) == (version, tokens.size)
    assert np.array_equal(read_shard(path), tokens)


def test_version_1_refuses_ids_past_uint16(tmp_path: Path) -> None:
    with pytest.raises(FeedError, match="token id 65536 does not fit a version 1 shard"):
        write_shard(tmp_path / "big.bin", np.array([65536]), 1)


def _shard_bytes(magic: int, version: int, count: int, tokens: bytes) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes() + tokens


CORRUPT = {
    "short header": (b"\x00" * 100, "truncated header (100 bytes"),
    "bad magic": (_shard_bytes(12345, 1, 2, b"\x01\x00\x02\x00"), "bad magic 12345"),
    "bad version": (
        _shard_bytes(20240520, 7, 2, b"\x01\x00\x02\x00"),
        "bad version 7 for magic 20240520 (expected 1)",
    ),
    "negative count": (_shard_bytes(20240520, 1, -3, b""), "token count -3 is negative"),
    "truncated tokens": (
        _shard_bytes(20240520, 1, 5, b"\x01\x00\x02\x00"),
        "truncated: the header says 5 tokens but the file holds 2",
    ),
    "half a token": (
        _shard_bytes(20240801, 7, 2, b"\x01\x00\x00\x00\x02\x00"),
        "truncated: the header says 2 tokens but the file holds 1 tokens and 2 stray byte(s)",
    ),
    # a count as an integer, never 1.49949e+06
    "a large shard cut mid-token": (
        _shard_bytes(20240520, 1, 1_500_000, b"\x01\x00" * 1_499_490 + b"\x01"),
        "the header says 1500000 tokens but the file holds 1499490 tokens and 1 stray byte(s)",
    ),
    "trailing bytes": (
        _shard_bytes(20240520, 1, 1, b"\x01\x00\x02\x00"),
        "the header says 1 tokens but the file holds 2 (trailing bytes",
    ),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_a_corrupt_shard_is_named(tmp_path: Path, write_shards, case: str) -> None:
    write_shards(tmp_path, [300])
    content, message = CORRUPT[case]
    (tmp_path / "shard_001.bin").write_bytes(content)
    with pytest.raises(FeedError) as failure:
        open_shards(str(tmp_path))
    assert str(failure.value).startswith(f"{tmp_path / 'shard_001.bin'}: ")
    assert message in str(failure.value)


def test_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FeedError, match=f"shards:{tmp_path}/nope: .*nope does not exist"):
        open_shards(str(tmp_path / "nope"))


def test_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("no shards here")
    with pytest.raises(FeedError, match=f"shards:{tmp_path}: {tmp_path} holds no \\*.bin shards"):
        open_shards(str(tmp_path))


def test_a_file_is_not_a_folder(tmp_path: Path, write_shards) -> None:
    write_shards(tmp_path, [10])
    with pytest.raises(FeedError, match="shard_000.bin is a file; shards: takes a folder"):
        open_shards(str(tmp_path / "shard_000.bin"))


def test_validation_shards_are_kept_apart(tmp_path: Path) -> None:
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(300), 1)
    write_shard(tmp_path / "fineweb_train_000001.bin", np.arange(400), 1)
    assert shard_corpus(str(tmp_path)).names == ("fineweb_train_000001.bin",)
    assert shard_corpus(str(tmp_path), "val").names == ("fineweb_val_000000.bin",)
    (tmp_path / "fineweb_train_000001.bin").unlink()
    with pytest.raises(FeedError, match="holds no train shards \\(only fineweb_val_000000.bin\\)"):
        open_shards(str(tmp_path))


def test_vocab_without_a_tokenizer_is_the_largest_id_plus_one(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.array([3, 900, 5] * 100), 1)
    write_shard(tmp_path / "b.bin", np.array([70_000, 1] * 100), 7)
    feed = open_shards(str(tmp_path))
    assert feed.vocab_size == 70_001
    assert "max token id + 1 over the shards: no tokenizer saved" in feed.describe()


@pytest.mark.parametrize(
    ("meta", "vocab_size"), [('{"kind": "bytes"}', 256), ('{"kind":"bpe","vocab_size":5000}', 5000)]
)
def test_vocab_from_the_saved_meta(tmp_path: Path, write_shards, meta: str, vocab_size: int):
    write_shards(tmp_path, [300])
    (tmp_path / "tokenizer_meta.json").write_text(meta)
    assert open_shards(str(tmp_path)).vocab_size == vocab_size


def test_vocab_from_a_saved_tokenizer_json(tmp_path: Path, write_shards) -> None:
    from tokenizers import Tokenizer, models

    write_shards(tmp_path, [300])
    vocab = {f"w{index}": index for index in range(1234)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    feed = open_shards(str(tmp_path))
    assert feed.vocab_size == 1234 and "(tokenizer.json)" in feed.describe()


def test_a_bad_meta_is_named(tmp_path: Path, write_shards) -> None:
    write_shards(tmp_path, [300])
    (tmp_path / "tokenizer_meta.json").write_text('{"kind": "bpe"}')
    with pytest.raises(FeedError, match='tokenizer_meta.json: expected .*got {"kind": "bpe"}'):
        open_shards(str(tmp_path))
