"""Freezing (``TrainConfig.freeze``, ``dataflow train --freeze``) on llama3_tiny and the
CPU: the patterns, the lowered program without gradient or optimizer objects for the
frozen fields and without the backward of a frozen bottom, a plan that never writes a
frozen weight back and peaks lower than full training's, a run whose frozen weights come
out bit-identical while the loss falls, and the command's plan line and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_training.drive.checkpoint import read_checkpoint
from dataflow_training.drive.run import TrainingRun
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.step.config import OptimizerPolicy, TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import load_family
from dataflow_training.step.freezing import FreezeError, frozen_names, parameter_counts
from dataflow_training.step.lowering import Lowered, lower

from dataflow import Program
from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")

PRESET = "llama3_tiny"  # 2 blocks; the head ties the embedding's table
FROZEN = ("embed", "layers.0")


@pytest.fixture(scope="module")
def llama3():
    return load_family("llama3")


def _train(**fields) -> TrainConfig:
    return TrainConfig(seq_len=16, batch=2, rounds=2, **fields)


def test_the_patterns_name_layers_ranges_and_globs(llama3) -> None:
    layers = llama3.layers(llama3.config(PRESET))
    assert frozen_names(layers, ["embed"]) == {"emb.embed_tokens.weight"}
    assert frozen_names(layers, ["head"]) == {"head.norm.weight"}
    blocks = frozen_names(layers, ["layers.0-1"])
    assert len(blocks) == 18 and blocks == frozen_names(layers, ["model.layers.0-1"])
    assert frozen_names(layers, ["layers.1.self_attn.*"]) == {
        f"1.self_attn.{p}_proj.weight" for p in "qkvo"
    }
    assert frozen_names(layers, ["*.mlp.down_proj.weight"]) == {
        "0.mlp.down_proj.weight",
        "1.mlp.down_proj.weight",
    }
    with pytest.raises(FreezeError, match=r"--freeze layers\.7: names no parameter"):
        frozen_names(layers, ["embed", "layers.7"])
    with pytest.raises(FreezeError, match=r"--freeze \*\.q_proj: names no parameter"):
        frozen_names(layers, ["*.q_proj"])  # the params are *.q_proj.weight
    with pytest.raises(FreezeError, match="nothing would train"):
        lower(llama3, PRESET, _train(freeze=("*",)))


def test_frozen_fields_have_no_gradient_optimizer_or_backward_objects(llama3) -> None:
    full = lower(llama3, PRESET, _train()).program
    frozen = lower(llama3, PRESET, _train(freeze=FROZEN)).program
    objects = {o.id for o in full.objects}
    kept = {o.id for o in frozen.objects}
    # the frozen fields' gradients and optimizer state, block 0's saved activations and
    # the gradients of the hidden states below block 1: gone, nothing else
    gone = {"dW_emb", "O_emb", "dW_0", "O_0"}
    gone |= {f"A_0_{r}_0" for r in range(2)} | {f"dy_0_{r}_{i}" for r in range(2) for i in (0, 1)}
    assert objects - kept == gone
    assert kept <= objects
    tasks = {t.id: t for t in frozen.tasks}
    assert set(tasks) == {t.id for t in full.tasks} - {
        *(
            f"{kind}_0_{r}_{layer}"
            for r in range(2)
            for kind, layer in (("bwd", 0), ("embbwd", "emb"))
        ),
        "opt_0_1_0",
        "opt_0_1_emb",
    }
    # block 1, the lowest with a backward, makes its weight gradients but no dx
    assert tasks["bwd_0_0_1"].outputs == ("dW_1",)
    # a frozen weight is only ever read
    assert not any({"W_emb", "W_0"} & set(t.mutates) for t in frozen.tasks)
    # a program written out keeps its freeze: read back, its layers freeze the same
    read = Lowered.read(Program.from_json(frozen.to_json()))
    assert read.layout.train.freeze == FROZEN
    assert frozen_names(read.layers, ["*"]) - trainable_names(read.layers) == frozen_names(
        read.layers, FROZEN
    )


def trainable_names(layers) -> set[str]:
    return {f"{layer.name}.{p.name}" for layer in layers for p in layer.params if p.trainable}


def _write_backs(compiled) -> set[str]:
    program = compiled.placement.plan.program
    return {o for t in (program.prologue, *program.tasks) for o in t.offloads}


def test_a_frozen_weight_is_never_written_back_and_the_peak_is_lower(llama3) -> None:
    def compiled(freeze, budget):
        return compile_step(
            llama3, PRESET, _train(freeze=freeze), budget_bytes=budget, cost=RooflineCost()
        )

    # at 700 KB every weight of full training crosses the link, each written back after
    # its update; a frozen one is streamed in and released, never written back
    tight = 700_000
    assert {"W_emb", "W_0", "W_1", "W_head"} <= _write_backs(compiled((), tight))
    streamed = compiled(FROZEN, tight)
    assert "W_0" in streamed.placement.plan.program.prologue.prefetches
    assert not {"W_emb", "W_0"} & _write_backs(streamed)
    # without a budget everything stays in fast memory: the frozen step's peak is smaller
    full_peak = compiled((), None).predicted()["fast_peak_bytes"]
    frozen_peak = compiled(FROZEN, None).predicted()["fast_peak_bytes"]
    assert frozen_peak < 0.7 * full_peak, (frozen_peak, full_peak)


def test_a_frozen_run_keeps_its_frozen_weights_bit_identical_and_learns(llama3) -> None:
    losses, before, after = _frozen_losses("torch", steps=8)
    frozen = frozen_names(llama3.layers(llama3.config(PRESET)), FROZEN)
    for name in before:
        assert torch.equal(before[name], after[name]) == (name in frozen), name
    assert losses[-1] < losses[0] - 0.5, losses


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--preset", PRESET, "--steps", "3", "--batch", "2", "--seq-len", "16",
        "--device", "cpu", "--lr", "3e-3", "--out", str(out), *extra,
    ]  # fmt: skip


def test_the_command_freezes_says_so_in_the_plan_line_and_resumes_frozen(llama3, tmp_path) -> None:
    out = tmp_path / "run"
    result = invoke(*_args(out, "--freeze", "embed", "--freeze", "layers.0"))
    assert result.exit_code == 0, result.output
    total, trainable = parameter_counts(lower(llama3, PRESET, _train(freeze=FROZEN)).layers)
    assert trainable < total
    plan = next(line for line in result.output.splitlines() if line.startswith("plan: "))
    assert "parameters " in plan and "(trainable " in plan, plan
    full = invoke(*_args(tmp_path / "full"))
    full_plan = next(line for line in full.output.splitlines() if line.startswith("plan: "))
    assert plan.split("; parameters ")[1] != full_plan.split("; parameters ")[1]
    weights, opt, manifest, _ = read_checkpoint(out / "step_000003")
    assert manifest["train"]["freeze"] == ["embed", "layers.0"]
    assert set(opt) == {"O_1", "O_head"}
    # a resume takes the run's freeze with its other options
    resumed = invoke(*_args(out, "--resume", "auto", "--steps", "4"))
    assert resumed.exit_code == 0, resumed.output
    assert "freeze" in next(x for x in resumed.output.splitlines() if x.startswith("resume"))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]


def test_a_pattern_that_names_nothing_is_one_line(tmp_path) -> None:
    result = invoke(*_args(tmp_path / "run", "--freeze", "layers.9"))
    assert_one_line_error(result, 1, "--freeze layers.9", "names no parameter")


def _frozen_losses(resolver: str, device: str = "cpu", steps: int = 3) -> tuple[list, dict, dict]:
    """A frozen llama3_tiny run's losses, weights before and after, on ``resolver``."""
    train = TrainConfig(seq_len=16, batch=2, freeze=FROZEN, optimizer=OptimizerPolicy(lr=3e-3))
    options = {"cost": RooflineCost()} if device == "cpu" else {}
    run = TrainingRun.of("llama3", PRESET, train, device=device, resolver=resolver, **options)
    before, _ = run.state()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.vocab_size, (2, 17), generator=g).to(device)
    batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    losses = [run.step(batch).loss for _ in range(steps)]
    after, _ = run.state()
    run.close()
    return losses, before, after


def test_the_compiled_resolver_runs_a_frozen_bottom_as_eager_does(monkeypatch) -> None:
    """The lowest block with a backward makes no dx: the compiled block functions write
    one value fewer (``aot_eager`` traces what inductor compiles)."""
    pytest.importorskip("dataflow_resolver_torch")
    from dataflow_resolver_torch import compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()
    eager, _, _ = _frozen_losses("torch")
    assert _frozen_losses("torch-compiled")[0] == eager
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("resolver", ["torch", "torch-compiled"])
def test_a_frozen_run_on_cuda_keeps_its_frozen_weights_and_learns(llama3, resolver) -> None:
    """On CUDA (bf16, the steps after the first replayed from a CUDA graph): the frozen
    weights come back bit-identical and the loss falls."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("dataflow_resolver_torch")
    losses, before, after = _frozen_losses(resolver, "cuda", steps=8)
    frozen = frozen_names(llama3.layers(llama3.config(PRESET)), FROZEN)
    for name in before:
        assert torch.equal(before[name], after[name]) == (name in frozen), name
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "adafactor", "muon"])
def test_the_step_holds_the_chosen_optimizers_state_and_none_for_frozen_fields(
    llama3, optimizer
) -> None:
    """What ``compile_step`` and the step search price is the lowered step: its optimizer
    objects are the chosen optimizer's state (fp32 here: AdamW two moments, Lion one,
    Adafactor factored, Muon a momentum), of the trainable fields only."""
    from dataflow_training.step.precision import pinned

    policy = pinned("fp32", "fp32").optimizer_policy(optimizer)

    def sizes(freeze) -> tuple[dict[str, int], dict[str, int]]:
        program = lower(llama3, PRESET, _train(optimizer=policy, freeze=freeze)).program
        of = {o.id: o.size_bytes for o in program.objects}
        return {k: v for k, v in of.items() if k.startswith("O_")}, of

    full, objects = sizes(())
    frozen, _ = sizes(FROZEN)
    assert set(frozen) == {"O_1", "O_head"} and all(frozen[k] == full[k] for k in frozen)
    weights = {k: objects[f"W_{k[2:]}"] for k in full}  # fp32, as the states
    if optimizer == "adamw":
        assert full == {k: 2 * w for k, w in weights.items()}
    elif optimizer == "lion":
        assert full == weights
    elif optimizer == "adafactor":
        assert sum(full.values()) < sum(weights.values()) / 10  # row and column factors
    else:  # Muon: a momentum per matrix (AdamW's moments for the embedding and norms)
        assert weights["O_0"] <= full["O_0"] < 2 * weights["O_0"]
