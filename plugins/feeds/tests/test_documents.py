"""``next_documents`` (``dataflow train --pack-documents``): the same batches as ``next``
with where each document starts: a text feed's files, a set of shards' end-of-text token
(their tokenizer's, or llm.c's GPT-2 one) and shard starts; a feed whose documents
nothing marks refuses in one line. The position moves alike, so a restore is exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.opening import open_embedded, open_shards, open_text
from dataflow_feed_shards.shard_format import write_shard
from dataflow_feed_shards.tokenizing import LLMC_GPT2_EOT, META


def _stream_starts(feed, window_start: int, count: int) -> np.ndarray:
    """Whether each of ``count`` stream offsets from ``window_start`` starts a piece (the
    test's own reckoning from the feed's piece order)."""
    feed._arrange(feed._epoch)
    starts = {0, *(int(end) for end in feed._ends[:-1])}
    return np.array([offset in starts for offset in range(window_start, window_start + count)])


def test_a_text_feeds_documents_are_its_files(tmp_path: Path) -> None:
    lengths = [5, 17, 3, 40, 9, 1, 26]
    for i, n in enumerate(lengths):
        (tmp_path / f"f{i}.txt").write_bytes(bytes([97 + i]) * n)
    feed, plain = (open_text(str(tmp_path), batch=2, seq_len=8) for _ in range(2))
    assert feed.documents == "each file a document"
    rows = 2 * 8
    for step in range(4):
        at = feed.state()["position"]
        tokens, targets, starts = feed.next_documents()
        same_tokens, same_targets = plain.next()
        assert torch.equal(tokens, same_tokens) and torch.equal(targets, same_targets)
        assert starts.dtype == torch.bool and starts.shape == (2, 9)
        expected = _stream_starts(feed, at, rows + 1)
        for row in range(2):
            assert starts[row].numpy().tolist() == expected[row * 8 : row * 8 + 9].tolist()
        # each file is its own letter: past the window's first token, a document starts
        # exactly where the letter changes
        window = np.concatenate([tokens.numpy().ravel(), targets.numpy()[-1, -1:]])
        assert (expected[1:] == (window[1:] != window[:-1])).all(), step
        assert feed.state() == plain.state()


def test_a_restored_feed_gives_the_same_documents(tmp_path: Path) -> None:
    for i in range(6):
        (tmp_path / f"f{i}.py").write_text("x = 1\n" * (i + 2))
    feed = open_text(str(tmp_path), batch=2, seq_len=8)
    feed.next_documents()
    saved = feed.state()
    after = [feed.next_documents() for _ in range(3)]
    feed.restore(saved)
    again = [feed.next_documents() for _ in range(3)]
    for one, two in zip(after, again, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_shards_documents_start_at_their_end_of_text_token(tmp_path: Path) -> None:
    """GPT-2 shards as llm.c writes them (uint16, no tokenizer beside them): every
    document begins with 50256."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=n) for n in (7, 30, 12, 3, 50, 20)]
    stream = np.concatenate([np.concatenate(([LLMC_GPT2_EOT], doc)) for doc in docs])
    write_shard(tmp_path / "fineweb_train_000001.bin", stream, 1)
    feed = open_shards(str(tmp_path), batch=2, seq_len=16)
    assert feed.corpus.document_token == LLMC_GPT2_EOT
    for _ in range(3):
        tokens, targets, starts = feed.next_documents()
        assert torch.equal(starts[:, :-1], (tokens == LLMC_GPT2_EOT) | _first(tokens, feed))
        assert torch.equal(starts[:, 1:], targets == LLMC_GPT2_EOT)


def _first(tokens: torch.Tensor, feed) -> torch.Tensor:
    """True at the stream's offset 0 (one shard: its only piece start)."""
    out = torch.zeros_like(tokens, dtype=torch.bool)
    if feed.state()["position"] == tokens.numel():  # the first step read offset 0
        out[0, 0] = True
    return out


def test_prepared_bpe_shards_start_documents_at_their_endoftext(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from dataflow.testing import invoke

    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"doc{i}.md").write_text(f"document {i}: " + "words and more words. " * 20)
    out = tmp_path / "bpe"
    result = invoke("data", "prepare", "--text", text, "--tokenizer", "bpe:300", "-o", out)
    assert result.exit_code == 0, result.output
    feed = open_shards(str(out), batch=1, seq_len=32)
    assert feed.corpus.document_token == 0  # data prepare trains <|endoftext|> as id 0
    assert "token 0" in feed.documents
    tokens, _, starts = feed.next_documents()
    assert starts[0, 0] and torch.equal(starts[0, 1:-1], tokens[0, 1:] == 0)


def test_a_feed_whose_documents_nothing_marks_refuses_in_one_line(tmp_path: Path) -> None:
    write_shard(tmp_path / "train_000.bin", np.arange(300) % 256, 1)
    (tmp_path / META).write_text(json.dumps({"kind": "bytes"}))
    feed = open_shards(str(tmp_path), batch=2, seq_len=8)
    assert feed.documents is None
    with pytest.raises(FeedError, match=r"^shards:.*nothing marks its documents") as caught:
        feed.next_documents()
    assert "\n" not in str(caught.value)


def test_the_embedded_feed_marks_its_files() -> None:
    feed = open_embedded("python-stdlib", batch=1, seq_len=4096)
    assert feed.documents == "each file a document"
    starts = torch.cat([feed.next_documents()[2] for _ in range(8)])
    assert starts.any()  # 32 K bytes of the stdlib cross a file boundary
