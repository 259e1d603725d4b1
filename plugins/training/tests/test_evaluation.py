"""Validation (``drive.evaluation``, ``step.forward_only``) on gpt2_tiny and the CPU: the
forward-only program, its loss against the training step's, its plan and engine peak in
the budget, ``--eval-every`` leaving the training stream as it was, and ``val_loss``
equal to ``dataflow eval --from`` of the same checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")

from dataflow_training.drive.eval_checkpoint import evaluate_checkpoint  # noqa: E402
from dataflow_training.drive.evaluation import EvalOptions, Evaluator  # noqa: E402
from dataflow_training.drive.options import TrainOptions  # noqa: E402
from dataflow_training.drive.run import TrainingRun  # noqa: E402
from dataflow_training.drive.trainer import train  # noqa: E402
from dataflow_training.plan.compiled_step import compile_step  # noqa: E402
from dataflow_training.step.config import TrainConfig  # noqa: E402
from dataflow_training.step.family import load_family  # noqa: E402
from dataflow_training.step.forward_only import lower_forward  # noqa: E402
from dataflow_training.step.freezing import parameter_counts  # noqa: E402

SHAPE = TrainConfig(seq_len=16, batch=2)
#: an evaluation and a separate ``dataflow eval`` of the same checkpoint run the same
#: program on the same weights and tokens: equal to this relative tolerance (float32
#: rounding of the mean; on the CPU they are bit-identical)
SAME_LOSS = 1e-6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A byte-level shards folder with a validation shard (``--val-tokens``)."""
    folder = tmp_path_factory.mktemp("data")
    corpus = folder / "corpus.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes() * 4)
    out = folder / "shards"
    result = invoke("data", "prepare", "--text", corpus, "--val-tokens", 2048, "-o", out)
    assert result.exit_code == 0, result.output
    assert (out / "val_000000.bin").is_file()
    return out


def test_the_forward_only_program_has_no_backward_saves_or_optimizer():
    step = lower_forward(load_family("gpt2"), "gpt2_tiny", SHAPE)
    kinds = [task.kind for task in step.program.tasks]
    assert kinds == ["embed", "fwd", "fwd", "head"]
    assert {p.kind for p in step.layout.packed.values()} == {"W"}
    assert all(slot.save is False for slot in step.layout.tasks.values() if slot.kind == "fwd")
    (head,) = [slot for slot in step.layout.tasks.values() if slot.kind == "head"]
    assert set(head.outputs) == {"loss"} and not head.mutates


@pytest.mark.parametrize(
    ("family", "preset", "overrides"),
    [
        ("gpt2", "gpt2_tiny", {}),
        ("olmoe", "olmoe_tiny", {}),
        ("olmoe", "olmoe_tiny", {"expert_shards": 4}),
    ],  # fmt: skip
    ids=["gpt2", "olmoe", "olmoe-4-shards"],
)
def test_the_eval_loss_is_the_training_steps_loss_of_the_same_batch(family, preset, overrides):
    """Before any update the training step's loss of a batch is the model's loss on it:
    the forward-only program must give the same number (olmoe: blocks with Aux, which
    the evaluation's forwards update in its own engine, and AuxTemp; with its experts in
    shards, a routing task and one a shard, whose loss is also the whole experts' within
    float32 rounding of the shards' sums)."""
    pytest.importorskip(f"dataflow_family_{family}")
    spec = "embedded:python-stdlib"
    evaluator = Evaluator(
        compile_step(family, preset, SHAPE, forward_only=True, overrides=overrides),
        EvalOptions(spec, SHAPE.batch * SHAPE.seq_len),
    )
    if overrides:
        kinds = [task.kind for task in evaluator.compiled.program.tasks]
        assert kinds.count("efwd") == 4 * (len(kinds) - 2 - kinds.count("efwd"))
    run = TrainingRun.of(family, preset, SHAPE, seed=3, overrides=overrides)
    val = evaluator.evaluate(run.host_weights())
    stats = run.step([evaluator.data[0]])
    run.close()
    assert val["val_tokens"] == 32 and val["val_loss"] == pytest.approx(stats.loss, rel=1e-6)
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_loss"]))
    if overrides:  # the same weights, evaluated with the experts whole
        whole = Evaluator(
            compile_step(family, preset, SHAPE, forward_only=True),
            EvalOptions(spec, SHAPE.batch * SHAPE.seq_len),
        )
        run = TrainingRun.of(family, preset, SHAPE, seed=3, overrides=overrides)
        assert whole.evaluate(run.host_weights())["val_loss"] == pytest.approx(
            val["val_loss"], rel=1e-5
        )
        run.close()


def test_the_forward_only_plan_and_engine_peak_stay_in_the_budget():
    budget = 600 * 1024  # less than a gpt2_tiny training step of this shape takes
    family = load_family("gpt2")
    step = compile_step(family, "gpt2_tiny", SHAPE, forward_only=True, budget_bytes=budget)
    training = compile_step(family, "gpt2_tiny", SHAPE)
    assert step.predicted()["fast_peak_bytes"] <= budget
    assert step.predicted()["fast_peak_bytes"] < training.predicted()["fast_peak_bytes"]
    evaluator = Evaluator(step, EvalOptions("embedded:python-stdlib", 64))
    run = TrainingRun.of(family, "gpt2_tiny", SHAPE)
    measured = evaluator.evaluate(run.host_weights())["eval_fast_peak_bytes"]
    assert 0 < measured <= budget


def test_parameter_counts_are_the_reference_models():
    family = load_family("gpt2")
    step = lower_forward(family, "gpt2_tiny", SHAPE)
    model = family.reference_model(step.config)
    total = sum(p.numel() for p in model.parameters())
    assert parameter_counts(step.layers) == (total, total)


def _options(shards: Path, out: Path, **extra) -> TrainOptions:
    return TrainOptions(
        family="gpt2",
        preset="gpt2_tiny",
        steps=4,
        out=out,
        data=f"shards:{shards}",
        batch=2,
        seq_len=16,
        lr=3e-3,
        checkpoint_every=2,
        **extra,
    )


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_eval_every_leaves_the_training_stream_and_equals_eval_of_the_checkpoint(shards, tmp_path):
    lines: list[str] = []
    plain = _options(shards, tmp_path / "plain")
    train(plain, out=_Lines(lines))
    evaluated = _options(shards, tmp_path / "eval", eval_every=2, eval_tokens=96)
    train(evaluated, out=_Lines(lines))
    assert any(line.startswith("eval: every 2 steps, 96 tokens (3 batch(es))") for line in lines)
    assert any("parameters 1" in line and "(trainable " in line for line in lines)
    without, with_eval = _metrics(plain.out), _metrics(evaluated.out)
    # the training batches after an evaluation are those without it: the same losses,
    # bit for bit, and the same feed position in every checkpoint
    assert [m["loss"] for m in with_eval] == [m["loss"] for m in without]
    for step in ("step_000002", "step_000004"):
        feed = [
            json.loads((o.out / step / "manifest.json").read_text())["feed"]
            for o in (plain, evaluated)
        ]
        assert feed[0] == feed[1]
    assert [m["step"] for m in with_eval if "val_loss" in m] == [2, 4]
    for m in with_eval:
        if "val_loss" not in m:
            continue
        again = evaluate_checkpoint(evaluated.out / f"step_{m['step']:06d}")
        assert again["step"] == m["step"] and again["val_tokens"] == 96
        assert again["val_loss"] == pytest.approx(m["val_loss"], rel=SAME_LOSS)
    # the same through the command, from the run folder (its newest checkpoint)
    result = invoke("eval", "--from", evaluated.out, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed["step"] == 4
    assert printed["val_loss"] == pytest.approx(with_eval[-1]["val_loss"], rel=SAME_LOSS)
    # another feed as the held-out data, fewer tokens
    result = invoke(
        "eval", "--from", evaluated.out, "--val-data", "embedded:python-stdlib", "--eval-tokens", 32
    )
    assert result.exit_code == 0, result.output
    assert "val_loss" in result.stdout and "over 32 tokens" in result.stdout


def test_eval_every_without_held_out_data_is_one_line(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes())
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--steps", 1, "--batch", 2, "--seq-len", 16,
        "--ga-rounds", 1, "--data", corpus, "--out", tmp_path / "run", "--device", "cpu",
        "--eval-every", 1,
    )  # fmt: skip
    assert_one_line_error(result, 1, "--eval-every", "--val-data")


def test_eval_from_a_folder_without_checkpoints_is_one_line(tmp_path):
    assert_one_line_error(invoke("eval", "--from", tmp_path), 1, "--from", str(tmp_path))
    assert_one_line_error(invoke("eval", "--from", tmp_path / "no"), 1, "--from")


class _Lines:
    """A text stream that keeps each line ``train`` prints."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> None:
        self.lines += [line for line in text.splitlines() if line]

    def flush(self) -> None:
        pass


def test_host_weights_park_the_engine_and_the_next_step_goes_on():
    run = TrainingRun.of("gpt2", "gpt2_tiny", SHAPE)
    tokens = torch.randint(0, 256, (2, 16))
    batch = [(tokens, torch.roll(tokens, -1, 1))]
    again = TrainingRun.of("gpt2", "gpt2_tiny", SHAPE)
    first = [run.step(batch).loss, again.step(batch).loss]
    run.host_weights()  # the engine is given back; the state stays on the host
    assert run.step(batch).loss == again.step(batch).loss
    assert first[0] == first[1]
    run.close()
    again.close()


def test_tensorboard_gets_val_loss_on_the_steps_that_evaluate():
    from dataflow_training.drive.components import TensorBoardMetrics

    class Recorder:  # the part of SummaryWriter the sink calls
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, name: str, value: float, step: int) -> None:
            self.scalars.append((name, value, step))

    writer = Recorder()
    sink = TensorBoardMetrics(writer)
    base = {"loss": 5.0, "lr": 1e-3, "grad_norm": None, "tok_s": 10.0, "step_s": 0.1}
    sink.write(1, base)
    sink.write(2, base | {"val_loss": 4.5, "val_ppl": math.exp(4.5)})
    val = [(name, step) for name, _, step in writer.scalars if name.startswith("val_")]
    assert val == [("val_loss", 2), ("val_ppl", 2)]


@pytest.mark.gpu
def test_eval_on_cuda_stays_in_the_budget_and_equals_eval_of_the_checkpoint(shards, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    budget = 1 << 30
    out = tmp_path / "run"
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--steps", 4, "--batch", 2, "--seq-len", 16,
        "--ga-rounds", 1, "--data", shards, "--out", out, "--device", "cuda",
        "--budget", "1GiB", "--eval-every", 2, "--eval-tokens", 96, "--checkpoint-every", 2,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    evaluated = [m for m in _metrics(out) if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [2, 4]
    for m in evaluated:
        assert 0 < m["eval_allocator_peak_bytes"] <= budget
        assert m["eval_fast_peak_bytes"] <= budget
    again = evaluate_checkpoint(out / "step_000004")
    # bf16 on CUDA: the same program and weights, kernels that may reduce in another order
    assert again["val_loss"] == pytest.approx(evaluated[-1]["val_loss"], rel=1e-3)


@pytest.mark.gpu
def test_host_weights_give_the_training_engines_device_memory_back():
    """The evaluation's engine checks its own allocator peak from where it loads: that is
    the budget's only if the training engine's memory is gone by then."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run = TrainingRun.of("gpt2", "gpt2_tiny", SHAPE, device="cuda")
    tokens = torch.randint(0, 256, (2, 16))
    run.step([(tokens, torch.roll(tokens, -1, 1))])
    during = torch.cuda.memory_allocated()
    run.host_weights()
    # at least the arena's planned peak is given back (libraries' workspaces may stay)
    assert during - torch.cuda.memory_allocated() >= run.compiled.predicted()["fast_peak_bytes"]
    run.close()


def test_glm5s_followers_read_their_leaders_selection_in_the_eval_step_too() -> None:
    """The forward-only program (``dataflow eval``, ``--eval-every``): its followers read
    their leader's selection too, so its loss of a batch is the training step's before
    any update (24 tokens, K = 16: sparse)."""
    pytest.importorskip("dataflow_family_glm")

    shape = TrainConfig(seq_len=24, batch=2)
    slots = lower_forward(load_family("glm5"), "glm5_tiny", shape).layout.tasks
    assert slots["fwd_0_0_2"].inputs["shared"] == ("AuxTemp_0_0_0",)
    evaluator = Evaluator(
        compile_step("glm5", "glm5_tiny", shape, forward_only=True),
        EvalOptions("embedded:python-stdlib", shape.batch * shape.seq_len),
    )
    run = TrainingRun.of("glm5", "glm5_tiny", shape, seed=3)
    val = evaluator.evaluate(run.host_weights())
    stats = run.step([evaluator.data[0]])
    run.close()
    assert val["val_loss"] == pytest.approx(stats.loss, rel=1e-6)
