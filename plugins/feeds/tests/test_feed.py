"""The feed protocol: batches, epochs, save/restore, rank/world shares, and the text and
embedded feeds' determinism. Shards of distinct tokens make each token name its place."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.opening import open_embedded, open_shards, open_text

from dataflow import get_plugin_manager


def _batches(feed, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [feed.next() for _ in range(count)]


def _same(left, right) -> bool:
    return len(left) == len(right) and all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(left, right, strict=True)
    )


def test_batches_are_consecutive_windows_and_shifted_targets(tmp_path: Path, write_shards):
    tokens = write_shards(tmp_path, [500])
    feed = open_shards(str(tmp_path), batch=3, seq_len=8)
    for step in range(2):
        inputs, targets = feed.next()
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (3, 8)
        window = tokens[step * 24 : step * 24 + 25]
        assert np.array_equal(inputs.numpy(), window[:-1].reshape(3, 8))
        assert np.array_equal(targets.numpy(), window[1:].reshape(3, 8))


def test_an_epoch_visits_every_shard_once_then_wraps(counting_shards) -> None:
    folder, tokens = counting_shards
    feed = open_shards(str(folder), batch=2, seq_len=50)
    seen, epochs = [], []
    for _ in range(60):
        seen.append(feed.next()[0].numpy().ravel())
        epochs.append(feed.state()["epoch"])
    first = np.concatenate(seen[: epochs.index(1)])
    per_step = 100
    assert first.size == (tokens.size - 1) // per_step * per_step  # the short tail skipped
    assert len(np.unique(first)) == first.size  # no token twice in an epoch
    assert epochs[-1] == 1 and epochs == sorted(epochs)


def test_the_piece_order_depends_on_the_seed_and_the_epoch(counting_shards) -> None:
    folder, _ = counting_shards
    steps_per_epoch = 4999 // 1000
    orders = set()
    for seed in range(4):
        feed = open_shards(str(folder), batch=1, seq_len=1000, seed=seed)
        firsts = [int(feed.next()[0][0, 0]) for _ in range(2 * steps_per_epoch)]
        again = open_shards(str(folder), batch=1, seq_len=1000, seed=seed)
        assert int(again.next()[0][0, 0]) == firsts[0]  # fixed by the seed
        orders.add(tuple(firsts[:steps_per_epoch]))
        orders.add(tuple(firsts[steps_per_epoch:]))
    assert len(orders) > 4  # seeds and epochs do not all share one order


@pytest.mark.parametrize("steps_before", [0, 3, 47, 52])  # 52 is past an epoch's end
def test_restore_continues_exactly(counting_shards, steps_before: int) -> None:
    folder, _ = counting_shards
    uninterrupted = open_shards(str(folder), batch=2, seq_len=48, seed=3)
    _batches(uninterrupted, steps_before)
    state = json.loads(json.dumps(uninterrupted.state()))  # what a checkpoint keeps
    expected = _batches(uninterrupted, 10)
    resumed = open_shards(str(folder), batch=2, seq_len=48, seed=3)
    resumed.restore(state)
    assert _same(_batches(resumed, 10), expected)


def test_the_state_names_shard_and_offset(tmp_path: Path, write_shards) -> None:
    write_shards(tmp_path, [500])
    feed = open_shards(str(tmp_path), batch=2, seq_len=10)
    _batches(feed, 3)
    state = feed.state()
    assert (state["shard"], state["offset"], state["epoch"], state["seed"]) == (
        "shard_000.bin",
        60,
        0,
        0,
    )


def test_restore_refuses_another_dataset(tmp_path: Path, write_shards) -> None:
    write_shards(tmp_path / "a", [400, 400])
    write_shards(tmp_path / "b", [400, 401])
    state = open_shards(str(tmp_path / "a")).state()
    with pytest.raises(FeedError, match="different dataset .*shard_001.bin holds 401 tokens, 400"):
        open_shards(str(tmp_path / "b")).restore(state)
    write_shards(tmp_path / "c", [400, 400, 400])
    with pytest.raises(FeedError, match="different dataset .*new here: shard_002.bin"):
        open_shards(str(tmp_path / "c")).restore(state)


@pytest.mark.parametrize(("option", "value"), [("batch", 3), ("seq_len", 16), ("seed", 1)])
def test_restore_refuses_other_options(counting_shards, option: str, value: int) -> None:
    folder, _ = counting_shards
    state = open_shards(str(folder), batch=2, seq_len=8).state()
    options = {"batch": 2, "seq_len": 8, option: value}
    with pytest.raises(FeedError, match=f"the saved position has {option} "):
        open_shards(str(folder), **options).restore(state)


def test_restore_refuses_what_is_not_a_state(counting_shards) -> None:
    folder, _ = counting_shards
    with pytest.raises(FeedError, match="not a saved feed position"):
        open_shards(str(folder)).restore({"epoch": 1})


def test_ranks_read_disjoint_shares(counting_shards) -> None:
    folder, tokens = counting_shards
    world, steps = 3, 5
    shares = []
    for rank in range(world):
        feed = open_shards(str(folder), batch=2, seq_len=20, seed=1, rank=rank, world=world)
        shares.append(np.concatenate([feed.next()[0].numpy().ravel() for _ in range(steps)]))
    every = np.concatenate(shares)
    assert len(np.unique(every)) == every.size == world * steps * 40
    single = open_shards(str(folder), batch=2 * world, seq_len=20, seed=1)
    together = np.concatenate([single.next()[0].numpy().ravel() for _ in range(steps)])
    assert np.array_equal(np.sort(every), np.sort(together))  # the same tokens, shared out


def test_a_bad_rank_is_named(counting_shards) -> None:
    folder, _ = counting_shards
    with pytest.raises(FeedError, match="rank 3 is not in 0..2 \\(world 3\\)"):
        open_shards(str(folder), rank=3, world=3)


def test_too_little_data_for_one_step(tmp_path: Path, write_shards) -> None:
    write_shards(tmp_path, [100])
    with pytest.raises(
        FeedError, match="holds 100 tokens; one step of batch 2 x seq_len 50 x world"
    ):
        open_shards(str(tmp_path), batch=2, seq_len=50)


def test_the_text_feed_reads_the_bytes_of_its_files(data_dir: Path) -> None:
    feed = open_text(str(data_dir / "text" / "river.txt"), batch=2, seq_len=16)
    text = np.frombuffer((data_dir / "text" / "river.txt").read_bytes(), dtype=np.uint8)
    inputs, targets = feed.next()
    assert np.array_equal(inputs.numpy().ravel(), text[:32])
    assert np.array_equal(targets.numpy().ravel(), text[1:33])
    assert feed.vocab_size == 256


def test_the_text_feed_of_a_folder(data_dir: Path) -> None:
    feed = open_text(str(data_dir / "text"), batch=2, seq_len=16)
    # sorted, recursive, text suffixes only; hidden folders and empty files skipped
    assert feed.corpus.names == ("notes/count.py", "notes/tally.md", "river.txt")
    assert _same(
        _batches(feed, 30), _batches(open_text(str(data_dir / "text"), batch=2, seq_len=16), 30)
    )
    assert feed.describe().startswith(f"text:{data_dir / 'text'}, 3 files, 838 tokens, vocab 256")


def test_a_missing_text_path(tmp_path: Path) -> None:
    with pytest.raises(FeedError, match=f"text:{tmp_path}/gone.txt: .*gone.txt does not exist"):
        open_text(str(tmp_path / "gone.txt"))
    with pytest.raises(FeedError, match=f"text:{tmp_path}: no non-empty text files"):
        open_text(str(tmp_path))


def test_the_embedded_corpus_is_the_stdlib_and_deterministic() -> None:
    feed = open_embedded("python-stdlib", batch=2, seq_len=32)
    names = feed.corpus.names
    assert list(names) == sorted(names) and all(name.endswith(".py") for name in names)
    assert "os.py" in names and not any("site-packages" in name for name in names)
    assert feed.corpus.folder == Path(sysconfig.get_paths()["stdlib"])
    assert feed.vocab_size == 256
    again = open_embedded("python-stdlib", batch=2, seq_len=32)
    assert _same(_batches(feed, 5), _batches(again, 5))
    state = feed.state()
    expected = _batches(feed, 3)
    again.restore(state)
    assert _same(_batches(again, 3), expected)


def test_an_unknown_embedded_corpus() -> None:
    with pytest.raises(FeedError, match="embedded:wikipedia: unknown embedded corpus"):
        open_embedded("wikipedia")


def test_the_registry_opens_spec_strings(counting_shards) -> None:
    folder, _ = counting_shards
    feeds = get_plugin_manager(autoload=False, allow=["dataflow-feed-shards"]).feeds()
    feed = feeds.open(f"shards:{folder}", batch=2, seq_len=8, seed=0, rank=0, world=1)
    assert feed.describe().startswith(f"shards:{folder}, 5 shards, 5.0 k tokens")
