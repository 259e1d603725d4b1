"""``dataflow train`` end to end on gpt2_tiny, on the CPU, with a small byte feed that
follows the feed protocol (docs: the feed protocol), installed as a fake distribution: a
run, its resume, and the one-line failures (kills, signals and damaged files: the chaos
suite, tests/chaos)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

#: a feed over a file's bytes: windows of batch x (seq_len + 1) from a position that a
#: seeded permutation of window starts fixes; its state is the window index
FEED = """
import hashlib, os
import torch
from dataflow import hookimpl
from dataflow.registry import FeedSpec


class ByteFeed:
    vocab_size = 256

    def __init__(self, location, batch, seq_len, seed, rank=0, world=1):
        if not os.path.isfile(location):
            raise ValueError(f"testbytes:{location}: no such file")
        data = open(location, "rb").read()
        self.data = torch.tensor(list(data), dtype=torch.int64)
        self.hash = hashlib.sha256(data).hexdigest()
        self.batch, self.seq_len, self.seed = batch, seq_len, seed
        self.windows = (len(data) - 1) // (seq_len + 1)
        self.index, self.epoch = 0, 0

    def _order(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(self.windows, generator=g)

    def next(self):
        rows = []
        for _ in range(self.batch):
            if self.index == self.windows:
                self.index, self.epoch = 0, self.epoch + 1
            start = int(self._order()[self.index]) * (self.seq_len + 1)
            rows.append(self.data[start : start + self.seq_len + 1])
            self.index += 1
        rows = torch.stack(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state(self):
        return {"index": self.index, "epoch": self.epoch, "hash": self.hash}

    def restore(self, state):
        if state["hash"] != self.hash:
            raise ValueError("testbytes: the state is of another file")
        self.index, self.epoch = state["index"], state["epoch"]

    def describe(self):
        return f"testbytes, {len(self.data)} bytes"


@hookimpl
def dataflow_feeds():
    return [FeedSpec("testbytes", ByteFeed, "bytes of one file (tests)")]
"""


@pytest.fixture
def site(fake_distribution) -> Path:
    """The folder the fake feed distribution is installed in (on sys.path here)."""
    dist_info = fake_distribution(
        "dataflow-feed-testbytes",
        entry_points={"testbytes": "dataflow_feed_testbytes"},
        modules={"dataflow_feed_testbytes": FEED},
    )
    from dataflow import set_default_plugin_manager

    set_default_plugin_manager(None)  # one built before this test never saw the feed
    return dist_info.parent


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    source = Path(json.__file__).parent / "decoder.py"
    path.write_bytes(source.read_bytes() * 4)
    return path


def _args(corpus: Path | None, out: Path, steps: int, *extra: str) -> list[str]:
    """``dataflow train`` of gpt2_tiny on the test feed over ``corpus`` (None: on the
    default data, the embedded corpus)."""
    data = [] if corpus is None else ["--data", f"testbytes:{corpus}"]
    return [
        "train",
        "--preset",
        "gpt2_tiny",
        "--steps",
        str(steps),
        *data,
        "--batch",
        "4",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--lr",
        "3e-3",
        "--warmup",
        "3",
        "--out",
        str(out),
        *extra,
    ]


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def test_train_30_steps_loss_falls(site, corpus, tmp_path):
    out = tmp_path / "run"
    result = invoke(*_args(corpus, out, 30, "--checkpoint-every", "10", "--keep", "2"))
    assert result.exit_code == 0, result.output
    assert "plan: gpt2-gpt2_tiny-train on cpu (measured): predicted" in result.output
    assert "tok/s" in result.output
    # not a terminal: plain progress lines (every ~5 % of the run), no bar
    assert re.search(
        r"^step 30/30 loss \d+\.\d{4} lr \S+ grad_norm \S+ tok/s ", result.output, re.M
    )
    assert "━" not in result.output
    assert re.search(
        r"^done: step 30, loss \d\.\d{4} -> \d\.\d{4}; fast peak ", result.output, re.M
    )
    losses = _losses(out)
    assert [s for s, _ in losses] == list(range(1, 31))
    lrs = [m["lr"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3])  # --warmup 3 up to --lr 3e-3
    assert lrs[-1] == pytest.approx(3e-4)  # cosine down to --min-lr-ratio 0.1
    first, last = sum(x for _, x in losses[:5]) / 5, sum(x for _, x in losses[-5:]) / 5
    assert last < first - 0.5, (first, last)  # bytes start near ln 256 = 5.5
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(metrics) == {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tok_s",
        "step_s",
        "predicted_step_s",
        "fast_peak_bytes",
        "allocator_peak_bytes",
    }
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == [
        "step_000020",
        "step_000030",
    ]
    manifest = json.loads((out / "step_000030" / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["feed"]["hash"]
    assert len(manifest["history"]) == 30 and manifest["history"][-1] == list(losses[-1])
    assert manifest["train"]["clip"] == 1.0 and manifest["family"] == "gpt2"


def test_corrupt_checkpoint_is_one_line(site, corpus, tmp_path):
    out = tmp_path / "run"
    assert invoke(*_args(corpus, out, 2)).exit_code == 0
    shard = out / "step_000002" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    result = invoke(*_args(corpus, out, 4, "--resume", "auto"))
    assert_one_line_error(result, 1, "model.safetensors")
    assert "corrupt" in result.output


def test_corrupt_data_shard_is_one_line(site, corpus, tmp_path):
    """Shards from ``dataflow data prepare``, one of them cut short: the run stops before
    step 1 with one line naming the shard."""
    pytest.importorskip("dataflow_feed_shards")
    shards = tmp_path / "shards"
    prepared = invoke("data", "prepare", "--text", corpus, "--tokenizer", "bytes", "-o", shards)
    assert prepared.exit_code == 0, prepared.output
    shard = sorted(shards.glob("*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:2000])
    args = _args(corpus, tmp_path / "run", 2)
    args[args.index("--data") + 1] = f"shards:{shards}"
    result = invoke(*args)
    assert_one_line_error(result, 1, shard.name)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_data_path_is_one_line(site, tmp_path):
    result = invoke(*_args(tmp_path / "nowhere.txt", tmp_path / "run", 2))
    assert_one_line_error(result, 1, "nowhere.txt")


def test_an_unknown_resolver_is_one_line_naming_the_known_ones(site, corpus, tmp_path):
    result = invoke(*_args(corpus, tmp_path / "run", 2, "--resolver", "jit"))
    assert_one_line_error(result, 1, "--resolver", "'jit'", "torch-compiled")


def test_a_bad_kernel_pin_is_one_line_before_planning(site, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("DATAFLOW_KERNELS", "attention_fwd=flash3")
    result = invoke(*_args(corpus, tmp_path / "run", 2))
    assert_one_line_error(result, 1, "DATAFLOW_KERNELS", "attention_fwd", "'flash3'", "cudnn")
    assert "plan:" not in result.stdout  # refused before the step was planned


def test_data_may_be_a_bare_path(tmp_path):
    import click
    from dataflow_training.cli.train_defaults import data_spec

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "train_000000.bin").write_bytes(b"")
    assert data_spec(str(text)) == f"text:{text}"
    assert data_spec(str(tmp_path)) == f"text:{tmp_path}"  # a folder of text files
    assert data_spec(str(shards)) == f"shards:{shards}"
    assert data_spec("nosuch:somewhere") == "nosuch:somewhere"  # the registry refuses it
    with pytest.raises(click.BadParameter, match="'gone.txt' is no file or folder here"):
        data_spec("gone.txt")
    result = invoke(*_args(None, tmp_path / "run", 2), "--data", tmp_path / "gone.txt")
    assert_one_line_error(result, 2, "--data", "gone.txt", "SCHEME:LOCATION")


def test_the_auto_resolver_compiles_on_cuda_only() -> None:
    from dataflow_training.drive.run import resolver_for

    assert resolver_for("auto", "cpu") == "torch"
    assert resolver_for("auto", "cuda:0") == "torch-compiled"  # resolvers/torch installed
    assert resolver_for("torch", "cuda") == "torch"
    assert resolver_for("torch-compiled", "cpu") == "torch-compiled"
    with pytest.raises(ValueError, match="known: auto, .*synthetic"):
        resolver_for("jit", "cpu")


def test_early_updates_train_by_layer_and_refuse_a_clip(site, corpus, tmp_path):
    """``--updates early`` with the default clip is a usage error naming the option;
    without a clip, by layer in a budget, the run trains (its loss falls) and its config
    records the updates."""
    refused = invoke(*_args(corpus, tmp_path / "clipped", 2, "--updates", "early"))
    assert_one_line_error(refused, 2, "--updates", "cannot clip", "--clip 0")
    out = tmp_path / "run"
    extra = ("--updates", "early", "--clip", "0", "--order", "layer", "--ga-rounds", "2")
    result = invoke(*_args(corpus, out, 8, *extra, "--budget", "8MiB"))
    assert result.exit_code == 0, result.output
    losses = [loss for _, loss in _losses(out)]
    assert losses[-1] < losses[0]
    manifest = (sorted(out.glob("step_*"))[-1] / "manifest.json").read_text()
    assert '"updates": "early"' in manifest


def test_infeasible_budget_names_the_budget_that_fits(site, corpus, tmp_path):
    result = invoke(*_args(corpus, tmp_path / "run", 2, "--budget", "64KiB"))
    assert_one_line_error(result, 1, "--budget")
    # the step search finds no shape: its line names the least budget one task needs
    assert "nothing fits: no step fits the 64 KiB budget; what would: a --budget of at " in (
        result.output
    )


def test_lower_writes_a_program_plan_reads(tmp_path):
    path = tmp_path / "step.json"
    result = invoke("lower", "--preset", "gpt2_tiny", "--batch", "2", "--seq-len", "16", "-o", path)
    assert result.exit_code == 0, result.output
    from dataflow import Program

    program = Program.from_json(path)
    assert program.name == "gpt2-gpt2_tiny-train"
    assert any(t.id.startswith("opt_0_0_") for t in program.tasks)
    planned = invoke("plan", path, "--budget", "64MiB", "-o", tmp_path / "planned.json")
    assert planned.exit_code == 0, planned.output


def test_export_hf_loads_in_transformers(site, corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    out = tmp_path / "run"
    assert invoke(*_args(corpus, out, 2)).exit_code == 0
    hf = tmp_path / "hf"
    result = invoke("export", "--hf", hf, "--from", out / "step_000002")
    assert result.exit_code == 0, result.output
    model = transformers.GPT2LMHeadModel.from_pretrained(hf, local_files_only=True)
    from safetensors.torch import load_file

    ours = load_file(out / "step_000002" / "model.safetensors")
    assert torch.equal(model.transformer.wte.weight.detach(), ours["emb.wte"])
    tokens = torch.randint(0, 256, (1, 16))
    assert torch.isfinite(model(tokens).logits).all()
    # the run's folder stands for its latest checkpoint
    result = invoke("export", "--hf", tmp_path / "hf_latest", "--from", out)
    assert result.exit_code == 0 and "step_000002 (step 2)" in result.output, result.output
    theirs = load_file(tmp_path / "hf_latest" / "model.safetensors")
    assert theirs.keys() == load_file(hf / "model.safetensors").keys()
    assert torch.equal(theirs["transformer.wte.weight"], ours["emb.wte"])
    # shards of at most --max-shard-size, with their index, load as the single file does
    sharded = tmp_path / "hf_sharded"
    result = invoke("export", "--hf", sharded, "--from", out, "--max-shard-size", "64KiB")
    assert result.exit_code == 0 and "shards and their index" in result.output, result.output
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    again = transformers.GPT2LMHeadModel.from_pretrained(sharded, local_files_only=True)
    assert torch.equal(again.transformer.wte.weight.detach(), ours["emb.wte"])
    result = invoke(
        "export", "--preset", "gpt2_tiny", "-o", tmp_path / "b", "--max-shard-size", "1MiB"
    )
    assert_one_line_error(result, 2, "--max-shard-size", "--hf")
    # a folder that is neither: one line naming it
    bare = tmp_path / "bare"
    bare.mkdir()
    result = invoke("export", "--hf", tmp_path / "hf_bare", "--from", bare)
    assert_one_line_error(result, 1, "--from", str(bare), "step_NNNNNN")


def test_a_loss_that_is_not_finite_stops_the_run_and_keeps_the_checkpoint(site, corpus, tmp_path):
    """A learning rate that blows the weights up: the run stops with one line naming the
    step and the kept checkpoint, which still loads."""
    out = tmp_path / "run"
    args = _args(corpus, out, 20, "--checkpoint-every", "1", "--clip", "0", "--warmup", "0")
    lr = args.index("--lr") + 1
    args[lr] = "1e12"
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert "not finite" in line and "is kept" in line, line
    kept = sorted(p for p in out.iterdir() if p.name.startswith("step_"))
    assert kept, "the first step's checkpoint is kept"
    manifest = json.loads((kept[-1] / "manifest.json").read_text())
    assert all(math.isfinite(loss) for _, loss in manifest["history"])


def test_progress_bar_renders_on_a_terminal(corpus, tmp_path):
    """Under a pseudo-terminal the run draws a rich bar (step, loss, tok/s, ETA) instead
    of the plain lines; the plan line and the closing line are there as always."""
    pytest.importorskip("dataflow_feed_shards")  # the text: feed
    primary, secondary = os.openpty()
    args = _args(corpus, tmp_path / "run", 6)
    args[args.index("--data") + 1] = f"text:{corpus}"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dataflow"), *args],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env={**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"},
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())
    assert "plan: gpt2-gpt2_tiny-train on cpu" in screen
    bar = re.search(r"step 6/6 ━+ loss (\d+\.\d{4})  [\d,]+ tok/s (\d+:\d\d:\d\d)", screen)
    assert bar, screen
    assert not re.search(r"^step \d+/6 loss", screen, re.M), screen  # no plain lines
    assert "done: step 6, loss " in screen
    assert float(bar[1]) == pytest.approx(_losses(tmp_path / "run")[-1][1], abs=1e-4)


@pytest.mark.gpu
def test_zero_config_on_a_gpu_takes_cuda_and_the_free_memory(tmp_path):
    """No --device and no --budget where CUDA is present: the run is on cuda, planned at
    the device's free memory (less the CUDA reserve), and the allocator's peak is kept."""
    import torch

    free, _total = torch.cuda.mem_get_info()
    out = tmp_path / "run"
    result = invoke("train", "--preset", "gpt2_tiny", "--steps", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "plan: gpt2-gpt2_tiny-train on cuda (measured): predicted" in result.output
    lines = result.output.splitlines()
    profiling = next(i for i, line in enumerate(lines) if line.startswith("profiling: "))
    first = next(i for i, line in enumerate(lines) if line.startswith("first steps: "))
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan: "))
    assert profiling < plan < first, lines  # each said before the stretch it explains
    assert "each block kind compiles" in lines[first] and "CUDA graph" in lines[first]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < metrics["allocator_peak_bytes"] <= free
    manifest = json.loads((out / "step_000002" / "manifest.json").read_text())
    assert 0.5 * free < manifest["budget_bytes"] <= free


def test_bf16_optimizer_states_train_and_a_resume_keeps_them(site, corpus, tmp_path):
    """``--optimizer-states bf16``: the checkpoint records bf16 moments and holds half the
    optimizer bytes of an fp32 run's; a resume without the option takes the run's (its
    ``resume:`` line says so) and continues, one that asks for fp32 is one line naming the
    differing field."""
    from dataflow_training.drive.checkpoint import read_checkpoint

    out, fp32 = tmp_path / "run", tmp_path / "fp32"
    result = invoke(*_args(corpus, out, 2, "--optimizer-states", "bf16"))
    assert result.exit_code == 0, result.output
    assert invoke(*_args(corpus, fp32, 2)).exit_code == 0
    _, opt, manifest, _ = read_checkpoint(out / "step_000002")
    _, opt_fp32, _, _ = read_checkpoint(fp32 / "step_000002")
    states = manifest["train"]["optimizer"]["state_dtypes"]
    assert states == {"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16"}
    assert set(opt) == set(opt_fp32)
    for name, packed in opt.items():
        assert 2 * packed.numel() * packed.element_size() == pytest.approx(
            opt_fp32[name].numel() * opt_fp32[name].element_size(), rel=0.01
        ), name
    refused = invoke(*_args(corpus, out, 4, "--resume", "auto", "--optimizer-states", "fp32"))
    assert_one_line_error(refused, 1, "train.optimizer.state_dtypes.exp_avg is 'bfloat16'")
    resumed = invoke(*_args(corpus, out, 4, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "optimizer_states bf16" in resumed.output.splitlines()[0]
    assert [step for step, _ in _losses(out)] == [1, 2, 3, 4]


def test_a_resume_takes_every_option_it_is_not_given(site, corpus, tmp_path):
    """``--out OUT --resume auto`` alone continues the run as it was started (preset, data,
    batch, lr, ... from its manifest) to its own --steps; an option given wins (and one
    that does not fit is refused naming it); at its last step there is nothing to do."""
    out = tmp_path / "run"
    assert invoke(*_args(corpus, out, 2)).exit_code == 0
    result = invoke("train", "--out", out, "--resume", "auto", "--steps", 3)
    assert result.exit_code == 0, result.output
    said = result.output.splitlines()[0]
    for taken in ("preset gpt2_tiny", "batch 4", "seq_len 32", "lr 0.003", "testbytes:"):
        assert taken in said, said
    assert "steps" not in said.split(": the options")[0].split(", ")[0]
    assert [step for step, _ in _losses(out)] == [1, 2, 3]
    result = invoke("train", "--out", out, "--resume", "auto")
    assert result.exit_code == 0, result.output
    assert "done: the run is at its last step (3); nothing trained" in result.output
    refused = invoke("train", "--out", out, "--resume", "auto", "--steps", 4, "--batch", 8)
    assert_one_line_error(refused, 1, "train.batch is 4")
    import torch

    if not torch.cuda.is_available():  # a run of a GPU machine resumed on this one
        manifest = out / "step_000003" / "manifest.json"
        data = json.loads(manifest.read_text())
        data["options"]["device"] = "cuda"
        manifest.write_text(json.dumps(data))
        result = invoke("train", "--out", out, "--resume", "auto", "--steps", 4)
        assert result.exit_code == 0, result.output
        assert "device" not in result.output.splitlines()[0]
    fresh = invoke("train", "--out", tmp_path / "none", "--resume", "auto")
    assert_one_line_error(fresh, 2, "--steps", "found no checkpoint in")
    missing = invoke("train", "--out", out, "--resume", tmp_path / "gone")
    assert_one_line_error(missing, 2, "--resume", "gone is not a folder")
