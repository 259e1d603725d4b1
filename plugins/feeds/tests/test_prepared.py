"""A prepared dataset is complete or refused: ``prepared.json`` written last, the folder
renamed into place, what a stopped prepare left continued (``--resume``) or started over
(``--replace``), and the files read and passed over counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.opening import open_shards
from dataflow_feed_shards.prepare import prepare
from dataflow_feed_shards.prepared import MANIFEST
from dataflow_feed_shards.shard_format import write_shard

from dataflow.testing import FAILURE_EXIT, USAGE_EXIT, assert_one_line_error, invoke


class Stop(Exception):
    """Raised from ``report`` to stop a prepare after some shards, as a kill would."""


def _stopped(text: Path, out: Path, after: int, tokenizer: str = "bytes", **options) -> Path:
    """Prepare ``text`` into ``out`` but stop once ``after`` shards are written; returns
    the folder it left beside ``out``."""
    shards = []

    def report(item) -> None:
        if item.path.suffix == ".bin":
            shards.append(item)
        if len(shards) == after:
            raise Stop

    with pytest.raises(Stop):
        prepare(text, tokenizer, out, report=report, **options)
    (left,) = out.parent.glob(f".{out.name}.prepare-*")
    return left


def _refused(location: str, *parts: str) -> str:
    """The ``FeedError`` opening ``shards:location`` raises; it names every one of ``parts``."""
    with pytest.raises(FeedError) as info:
        open_shards(location)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))
    return str(info.value)


def _bytes_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _without_target(manifest: Path) -> dict:
    return {
        key: value for key, value in json.loads(manifest.read_text()).items() if key != "target"
    }


@pytest.mark.parametrize(
    ("tokenizer", "options"),
    [("bytes", {"shard_tokens": 100}), ("bpe:280", {"shard_tokens": 60, "val_tokens": 50})],
)
def test_a_stopped_prepare_resumes_to_the_same_bytes(tmp_path, data_dir, tokenizer, options):
    text = data_dir / "text"
    whole = prepare(text, tokenizer, tmp_path / "whole", **options)
    left = _stopped(text, tmp_path / "out", 3, tokenizer, **options)
    assert not (tmp_path / "out").exists()  # nothing at the target until it is complete
    result = invoke(
        "data", "prepare", "--text", text, "--tokenizer", tokenizer, "-o", tmp_path / "out",
        "--resume", *[f"--{key.replace('_', '-')}={value}" for key, value in options.items()],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"resume: continuing {left} (3 shard(s) kept)" in result.output
    assert not left.exists() and not list(tmp_path.glob(".out.*"))
    expected, got = _bytes_of(tmp_path / "whole"), _bytes_of(tmp_path / "out")
    assert expected.pop(MANIFEST) and got.pop(MANIFEST)
    assert got == expected
    assert _without_target(tmp_path / "out" / MANIFEST) == _without_target(
        tmp_path / "whole" / MANIFEST
    )
    assert whole.shards == len([name for name in got if name.endswith(".bin")])


def test_what_a_stopped_prepare_left_is_refused_in_one_line(tmp_path, data_dir):
    out = tmp_path / "out"
    left = _stopped(data_dir / "text", out, 2, shard_tokens=100)
    resume = (
        f"dataflow data prepare --text {data_dir / 'text'} --tokenizer bytes -o {out} "
        "--shard-tokens 100 --resume"
    )
    _refused(str(out), f"{out} does not exist", f"(2 shard(s) written, in {left})", resume)
    _refused(str(left), f"{left} is an unfinished dataflow data prepare", resume)
    again = invoke("data", "prepare", "--text", data_dir / "text", "-o", out)
    assert_one_line_error(again, FAILURE_EXIT, str(left), "--resume", "--replace")
    other = invoke(
        "data", "prepare", "--text", data_dir / "text", "-o", out, "--resume",
        "--shard-tokens", 200,
    )  # fmt: skip
    assert_one_line_error(other, FAILURE_EXIT, "--shard-tokens 100, this run has 200", "--replace")
    both = invoke(
        "data", "prepare", "--text", data_dir / "text", "-o", out, "--resume", "--replace"
    )
    assert_one_line_error(both, USAGE_EXIT, "--resume", "--replace")
    replaced = invoke("data", "prepare", "--text", data_dir / "text", "-o", out, "--replace")
    assert replaced.exit_code == 0, replaced.output
    assert f"removed {left}" in replaced.output and not left.exists()
    assert open_shards(str(out)).corpus.total_tokens == 838


def test_a_damaged_kept_shard_is_not_continued(tmp_path, data_dir):
    left = _stopped(data_dir / "text", tmp_path / "out", 2, shard_tokens=100)
    write_shard(left / "train_000002.bin", np.arange(50), 1)
    result = invoke(
        "data", "prepare", "--text", data_dir / "text", "-o", tmp_path / "out",
        "--shard-tokens", 100, "--resume",
    )  # fmt: skip
    assert_one_line_error(result, FAILURE_EXIT, "train_000002.bin", "100 tokens", "--replace")


def test_a_running_prepare_is_left_alone(tmp_path, data_dir):
    left = _stopped(data_dir / "text", tmp_path / "out", 1, shard_tokens=100)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = left.with_name(f".out.prepare-{sleeper.pid}")
        left.rename(running)
        for flag in ("--resume", "--replace"):
            result = invoke(
                "data", "prepare", "--text", data_dir / "text", "-o", tmp_path / "out", flag
            )
            assert_one_line_error(result, FAILURE_EXIT, f"(pid {sleeper.pid}) is writing it now")
        _refused(str(tmp_path / "out"), f"(pid {sleeper.pid}) is writing it now")
        assert running.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_replace_swaps_a_dataset_and_touches_nothing_else(tmp_path, data_dir):
    out = tmp_path / "out"
    prepare(data_dir / "text", "bytes", out, shard_tokens=100)
    resumed = invoke("data", "prepare", "--text", data_dir / "text", "-o", out, "--resume")
    assert_one_line_error(resumed, FAILURE_EXIT, "--shard-tokens 100, this run has 100000000")
    same = invoke(
        "data", "prepare", "--text", data_dir / "text", "-o", out, "--resume",
        "--shard-tokens", 100,
    )  # fmt: skip
    assert same.exit_code == 0 and "complete already (9 shard(s)): nothing to do" in same.output
    replaced = invoke("data", "prepare", "--text", data_dir / "text", "-o", out, "--replace")
    assert replaced.exit_code == 0, replaced.output
    assert sorted(path.name for path in out.glob("*.bin")) == ["train_000001.bin"]
    assert os.listdir(tmp_path) == ["out"]
    (out / "notes.txt").write_text("mine")
    refused = invoke("data", "prepare", "--text", data_dir / "text", "-o", out, "--replace")
    assert_one_line_error(refused, FAILURE_EXIT, str(out / "notes.txt"), "not a file")
    assert (out / "notes.txt").read_text() == "mine"


def test_a_stopped_replace_resumes_and_swaps(tmp_path, data_dir):
    out = tmp_path / "out"
    prepare(data_dir / "text", "bytes", out, shard_tokens=100)
    _stopped(data_dir / "text", out, 1, mode="replace", shard_tokens=300)
    assert open_shards(str(out)).corpus.lengths[0] == 100  # the old one, still whole
    (out / MANIFEST).write_text("{")  # a garbled record does not block its replacing
    again = invoke("data", "prepare", "--text", data_dir / "text", "-o", out)
    assert_one_line_error(again, FAILURE_EXIT, "was killed", "--resume", "--replace")
    result = invoke(
        "data", "prepare", "--text", data_dir / "text", "-o", out, "--resume",
        "--shard-tokens", 300,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "replaced the dataset that was in" in result.output
    assert open_shards(str(out)).corpus.lengths == (300, 300, 238)
    assert os.listdir(tmp_path) == ["out"]


def test_the_feed_checks_the_folder_against_its_manifest(tmp_path, data_dir):
    out = tmp_path / "out"
    prepare(data_dir / "text", "bytes", out, shard_tokens=300)
    write_shard(out / "extra.bin", np.arange(10), 1)
    _refused(str(out), f"{out / 'extra.bin'} is not one of the 3 shard(s)")
    (out / "extra.bin").unlink()
    write_shard(out / "train_000002.bin", np.arange(299), 1)
    with pytest.raises(
        FeedError, match="train_000002.bin holds 299 tokens, prepared.json says 300"
    ):
        open_shards(str(out))
    (out / "train_000002.bin").unlink()
    _refused(str(out), "train_000002.bin is missing: prepared.json lists 3", "--replace")
    (out / MANIFEST).write_text("{")
    _refused(str(out), f"{out / MANIFEST}: not readable JSON")


def test_the_training_cli_refuses_an_unfinished_folder_in_one_line(tmp_path, data_dir):
    # the feeds install alone (nox -s isolated): `dataflow train` comes with the training plugin
    pytest.importorskip("dataflow_training", reason="dataflow train needs dataflow-training")
    left = _stopped(data_dir / "text", tmp_path / "out", 2, shard_tokens=100)
    args = ["train", "--preset", "gpt2_tiny", "--device", "cpu", "--steps", 1]
    result = invoke(*args, "--data", f"shards:{left}", "--out", tmp_path / "run")
    assert_one_line_error(result, FAILURE_EXIT, str(left), "unfinished", "--resume")


def test_it_counts_what_it_read_and_what_it_passed_over(tmp_path, data_dir):
    text = tmp_path / "text"
    (text / ".git").mkdir(parents=True)
    (text / ".git" / "HEAD").write_text("ref")
    (text / "deep").mkdir()
    for name in ("a.txt", "deep/b.md", "deep/c.py", "logo.png", "deep/d.png", "Makefile"):
        (text / name).write_text("hello world\n")
    (text / "empty.txt").touch()
    (text / ".env").write_text("x")
    result = invoke("data", "prepare", "--text", text, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (
        "read 3 text file(s) (1 empty, passed over); skipped 3 other file(s): 1 without "
        "extension, 2 .png; 2 hidden file(s) or folder(s) not looked into"
    ) in result.output
    source = json.loads((tmp_path / "out" / MANIFEST).read_text())["source"]
    assert source["files"] == 3 and source["skipped"] == {"": 1, ".png": 2}
    one = invoke("data", "prepare", "--text", text / "a.txt", "-o", tmp_path / "one")
    assert "read 1 text file(s)\n" in one.output


@pytest.mark.parametrize("out", [".", ".."])
def test_the_working_directory_is_never_the_target(tmp_path, data_dir, monkeypatch, out):
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = sorted(p.name for p in (tmp_path / "work").iterdir())
    result = invoke("data", "prepare", "--text", data_dir / "text", "-o", out)
    assert_one_line_error(result, FAILURE_EXIT, "is the working directory or holds it", "-o")
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == before
    assert list(work.iterdir()) == []
