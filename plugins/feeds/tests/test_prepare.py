"""``dataflow data prepare``: text into shards that the shards feed reads back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dataflow_feed_shards.corpus import text_files
from dataflow_feed_shards.opening import open_shards
from dataflow_feed_shards.prepare import prepare
from dataflow_feed_shards.shard_format import read_header, read_shard

from dataflow.testing import FAILURE_EXIT, USAGE_EXIT, assert_one_line_error, invoke


def _text_bytes(folder: Path) -> np.ndarray:
    """The folder's text files, read by hand in sorted order: the independent reference."""
    files = sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.suffix in (".txt", ".md", ".py") and ".hidden" not in path.parts
    )
    return np.frombuffer(b"".join((folder / name).read_bytes() for name in files), np.uint8)


def test_bytes_shards_hold_the_text(tmp_path: Path, data_dir: Path) -> None:
    text = data_dir / "text"
    result = invoke(
        "data", "prepare", "--text", text, "-o", tmp_path / "out", "--shard-tokens", 300
    )
    assert result.exit_code == 0, result.output
    names = sorted(path.name for path in (tmp_path / "out").glob("*.bin"))
    assert names == ["train_000001.bin", "train_000002.bin", "train_000003.bin"]
    assert [read_header(tmp_path / "out" / name) for name in names] == [
        (1, 300),
        (1, 300),
        (1, 238),
    ]
    stream = np.concatenate([read_shard(tmp_path / "out" / name) for name in names])
    assert np.array_equal(stream, _text_bytes(text))
    assert json.loads((tmp_path / "out" / "tokenizer_meta.json").read_text()) == {"kind": "bytes"}
    assert "wrote " in result.output and "3 shard(s)" in result.output
    assert open_shards(str(tmp_path / "out")).vocab_size == 256
    assert open_shards(str(tmp_path / "out")).tokenizer == "bytes"


def test_the_shipped_shards_are_what_prepare_writes(tmp_path: Path, data_dir: Path) -> None:
    prepare(data_dir / "text", "bytes", tmp_path, val_tokens=256)
    for name in ("val_000000.bin", "train_000001.bin", "tokenizer_meta.json"):
        assert (tmp_path / name).read_bytes() == (data_dir / "shards" / name).read_bytes(), name


def test_a_validation_shard_comes_first(tmp_path: Path, data_dir: Path) -> None:
    done = prepare(data_dir / "text", "bytes", tmp_path, val_tokens=100, shard_tokens=10**6)
    shards = [item.path.name for item in done.written if item.path.suffix == ".bin"]
    assert shards == ["val_000000.bin", "train_000001.bin"]
    assert read_header(tmp_path / "val_000000.bin") == (1, 100)
    assert read_header(tmp_path / "train_000001.bin") == (1, 738)
    assert "1 validation shard(s) left out" in open_shards(str(tmp_path)).describe()


def test_bpe_shards_decode_to_the_text(tmp_path: Path, data_dir: Path) -> None:
    from tokenizers import Tokenizer

    text = data_dir / "text"
    result = invoke("data", "prepare", "--text", text, "--tokenizer", "bpe:300", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 300
    version, count = read_header(tmp_path / "train_000001.bin")
    tokens = read_shard(tmp_path / "train_000001.bin")
    assert version == 1 and count < _text_bytes(text).size  # merges shorten the text
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    pieces = np.split(tokens, np.flatnonzero(tokens == end_of_text))
    decoded = [tokenizer.decode([int(t) for t in piece[1:]]) for piece in pieces if piece.size]
    assert decoded == [path.read_text() for path in text_files(text) if path.stat().st_size]
    feed = open_shards(str(tmp_path))
    assert feed.vocab_size == 300 and "bpe" in feed.describe()
    assert feed.tokenizer == (tmp_path / "tokenizer.json").resolve()  # what training keeps
    (tmp_path / "tokenizer_meta.json").unlink()
    (tmp_path / "tokenizer.json").unlink()
    assert open_shards(str(tmp_path)).tokenizer is None  # nothing says


def test_a_saved_tokenizer_json_tokenizes_the_same(tmp_path: Path, data_dir: Path) -> None:
    prepare(data_dir / "text", "bpe:280", tmp_path / "first")
    prepare(data_dir / "text", str(tmp_path / "first" / "tokenizer.json"), tmp_path / "second")
    first, second = (read_shard(tmp_path / f / "train_000001.bin") for f in ("first", "second"))
    assert np.array_equal(first, second)


def test_a_vocabulary_past_uint16_writes_version_7(tmp_path: Path, data_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{index}": index for index in range(70_000)} | {"river": 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    prepare(data_dir / "text" / "river.txt", str(tmp_path / "big.json"), tmp_path / "out")
    assert read_header(tmp_path / "out" / "train_000001.bin")[0] == 7
    assert 70_000 in read_shard(tmp_path / "out" / "train_000001.bin")
    assert open_shards(str(tmp_path / "out"), batch=1, seq_len=8).vocab_size == 70_001


@pytest.mark.parametrize(
    ("arguments", "code", "culprits"),
    [
        (["--text", "{tmp}/missing"], USAGE_EXIT, ["--text", "missing"]),
        (["--tokenizer", "words"], USAGE_EXIT, ["--tokenizer", "words"]),
        (["--tokenizer", "bpe:10"], FAILURE_EXIT, ["bpe:10", "257"]),
        (["--shard-tokens", "0"], USAGE_EXIT, ["--shard-tokens"]),
        (["--val-tokens", "5000"], FAILURE_EXIT, ["--val-tokens 5000", "838 tokens"]),
        (["--text", "{tmp}/empty"], FAILURE_EXIT, ["empty", "no non-empty text files"]),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, data_dir: Path, arguments, code, culprits):
    (tmp_path / "empty").mkdir()
    arguments = [argument.format(tmp=tmp_path) for argument in arguments]
    if "--text" not in arguments:
        arguments = ["--text", str(data_dir / "text"), *arguments]
    result = invoke("data", "prepare", *arguments, "-o", tmp_path / "out")
    assert_one_line_error(result, code, *culprits)
    assert not list((tmp_path / "out").glob("*.bin")) if (tmp_path / "out").exists() else True


def test_a_folder_with_shards_is_not_overwritten(tmp_path: Path, data_dir: Path) -> None:
    prepare(data_dir / "text", "bytes", tmp_path)
    result = invoke("data", "prepare", "--text", data_dir / "text", "-o", tmp_path)
    assert_one_line_error(
        result, FAILURE_EXIT, str(tmp_path), "already holds a prepared dataset", "--replace"
    )
