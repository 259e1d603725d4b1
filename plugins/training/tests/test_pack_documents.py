"""``dataflow train --pack-documents`` (issue 49 item 3): rows of the feed's stream hold
several documents, each apart (the step lowered with ``TrainConfig.segments``, each
round's segments from the feed's ``next_documents``). On llama3_tiny and the CPU: ten
steps on the embedded default learn; a run stopped and resumed repeats the straight run
exactly (the feed's position is the same as without packing); the manifest keeps the
option, a resume takes it; a family whose attention takes no segments and a feed that
marks no documents are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dataflow_training.drive.checkpoint import read_checkpoint

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")
pytest.importorskip("dataflow_feed_shards")


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "llama3_tiny", "--steps", str(steps), "--batch", "4",
        "--seq-len", "64", "--ga-rounds", "2", "--device", "cpu", "--lr", "3e-3",
        "--schedule", "constant", "--checkpoint-every", "3", "--out", str(out), *extra,
    ]  # fmt: skip


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> Path:
    """Text files of 20 to 120 bytes: every row of 64 holds a few documents."""
    folder = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    for i in range(200):
        words = " ".join(f"w{int(w)}" for w in rng.integers(0, 30, size=int(rng.integers(5, 30))))
        (folder / f"doc_{i:03d}.txt").write_text(f"# {i}\n{words}\n")
    return folder


def test_ten_packed_steps_on_the_embedded_default_learn(tmp_path) -> None:
    out = tmp_path / "run"
    result = invoke(
        "train", "--preset", "llama3_tiny", "--steps", "10", "--batch", "4", "--seq-len",
        "128", "--device", "cpu", "--lr", "3e-3", "--out", str(out), "--pack-documents",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "embedded:python-stdlib" in result.output
    assert "documents packed apart (each file a document)" in result.output
    losses = [m["loss"] for m in _metrics(out)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
    _, _, manifest, _ = read_checkpoint(out / "step_000010")
    assert manifest["train"]["segments"] is True
    assert manifest["options"]["pack_documents"] is True


def test_a_packed_run_resumed_repeats_the_straight_run(small_files, tmp_path) -> None:
    data = ("--data", f"text:{small_files}", "--pack-documents")
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert invoke(*_args(straight, 6, *data)).exit_code == 0
    assert invoke(*_args(out, 3, *data)).exit_code == 0
    resumed = invoke(*_args(out, 6, "--data", f"text:{small_files}", "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "pack_documents True" in resumed.output  # taken from the run's options
    assert [m["loss"] for m in _metrics(out)] == [m["loss"] for m in _metrics(straight)]
    mine, opt, manifest, _ = read_checkpoint(out / "step_000006")
    theirs, their_opt, their_manifest, _ = read_checkpoint(straight / "step_000006")
    assert manifest["feed"] == their_manifest["feed"]
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    for name in their_opt:
        assert torch.equal(opt[name], their_opt[name]), name
    # the same tokens unpacked train otherwise: the packing reached the step
    plain = tmp_path / "plain"
    assert invoke(*_args(plain, 3, "--data", f"text:{small_files}")).exit_code == 0
    assert _metrics(plain)[0]["loss"] != _metrics(straight)[0]["loss"]


def test_a_family_whose_attention_takes_no_segments_is_one_line(tmp_path) -> None:
    pytest.importorskip("dataflow_family_gpt2")
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--steps", "1", "--batch", "2", "--seq-len", "32",
        "--device", "cpu", "--out", str(tmp_path / "run"), "--pack-documents",
    )  # fmt: skip
    assert_one_line_error(result, 1, "family 'gpt2'", "FusedQKVAttention", "--pack-documents")


def test_a_feed_that_marks_no_documents_is_one_line(tmp_path) -> None:
    from dataflow_feed_shards.shard_format import write_shard
    from dataflow_feed_shards.tokenizing import META

    data = tmp_path / "bytes"
    data.mkdir()
    write_shard(data / "train_000.bin", np.arange(5000) % 256, 1)
    (data / META).write_text(json.dumps({"kind": "bytes"}))
    result = invoke(*_args(tmp_path / "run", 1, "--data", f"shards:{data}", "--pack-documents"))
    assert_one_line_error(result, 1, "--pack-documents", f"shards:{data}", "marks no documents")


@pytest.mark.gpu
def test_a_packed_bf16_run_on_cuda_learns_and_resumes_exactly(small_files, tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    data = ("--data", f"text:{small_files}", "--pack-documents", "--device", "cuda")
    straight, out = tmp_path / "straight", tmp_path / "run"
    whole = invoke(*_args(straight, 10, *data, "--budget", "64MiB"))
    assert whole.exit_code == 0, whole.output
    losses = [m["loss"] for m in _metrics(straight)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert invoke(*_args(out, 6, *data, "--budget", "64MiB")).exit_code == 0
    resumed = invoke(*_args(out, 10, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    # bf16 on CUDA: the same program and data; kernels may reduce in another order
    again = [m["loss"] for m in _metrics(out)]
    assert again == pytest.approx(losses, rel=1e-2)


def test_a_packed_run_replayed_on_cuda_is_told_its_attention_runs_the_masked_kernel(
    tmp_path,
) -> None:
    """Only a packed run on CUDA replayed from a graph gets the line (its attention cannot
    read the documents' layout on the host there); it names the way out, --no-graph."""
    from dataflow_training.drive.options import TrainOptions
    from dataflow_training.drive.trainer import packed_attention_warning

    def options(**fields):
        base = {"device": "cuda", "graph": True, "pack_documents": True}
        return TrainOptions("llama3", "llama3_tiny", 1, tmp_path, **(base | fields))

    line = packed_attention_warning(options())
    assert line is not None and "--no-graph" in line and "--pack-documents" in line
    for other in ({"device": "cpu"}, {"graph": False}, {"pack_documents": False}):
        assert packed_attention_warning(options(**other)) is None, other


def test_predict_prices_the_packed_step(tmp_path) -> None:
    """``dataflow predict --pack-documents``: the step with each round's segments,
    priced as the dense step's work (its segments moved like its tokens)."""
    grid = (
        "predict", "--preset", "llama3_tiny", "--t-round", "512", "--tokens-step", "1024",
        "--seq-len", "128", "--budget", "0.01", "--jobs", "1",
    )  # fmt: skip
    rows = []
    for extra in ((), ("--pack-documents",)):
        out = tmp_path / f"rows{len(extra)}.json"
        result = invoke(*grid, *extra, "--json", str(out))
        assert result.exit_code == 0, result.output
        (row,) = json.loads(out.read_text())["rows"]
        assert row["feasible"], row
        rows.append(row)
    dense, packed = rows
    assert packed["step_s"] == pytest.approx(dense["step_s"], rel=0.05)
    result = invoke("predict", "--preset", "llama3_tiny", "--budget", "1", "--pack-documents")
    assert_one_line_error(result, 2, "--pack-documents predicts a grid")
