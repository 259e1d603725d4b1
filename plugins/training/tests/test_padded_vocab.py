"""A vocabulary stored padded (``vocab_multiple``, issue 44 item 5): the token table and
the output projection have their rows rounded up to a multiple of 64 in the step, and
nothing else changes.

Held to an independent plain-autograd reference, the family's reference model (its
``state_dict`` has the real vocabulary's shapes) trained by ``torch.optim.AdamW`` in
float64: the engine runs float32, so losses and gradients agree to float32 rounding
(``RTOL``/``ATOL`` below), and the weights after three updates to a few float32 steps of
AdamW (``WEIGHT_ATOL``). The padded rows are checked exactly: zero in the weights, the
gradients and both AdamW moments after every update, weight decay on."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.drive.checkpoint import MODEL_FILE
from dataflow_training.drive.run import TrainingRun
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import embed_layer, load_family, state_rows
from dataflow_training.testing import float64_reference
from safetensors.torch import load_file

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_family_llama3")

VOCAB = 300  # stored as 320 rows
STEPS, BATCH, SEQ = 3, 2, 16
LR = 1e-3
#: float32 engine against the float64 reference: loss and every gradient
RTOL, ATOL = 1e-4, 1e-6
#: weights after STEPS AdamW updates: each update moves a weight by at most about LR, and
#: float32 rounding of a gradient near zero may change its update by that much
WEIGHT_ATOL = 1e-5
#: (family, preset, overrides): GPT-2's head tied to its ``wte``; Llama's untied, so both
#: the embedding's table and ``lm_head.weight`` are padded
CASES = [
    ("gpt2", "gpt2_tiny", {}),
    ("llama3", "llama3_tiny", {"tie_word_embeddings": False}),
]
IDS = [case[0] for case in CASES]


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    tokens[0, :3] = VOCAB - 1  # the last real id: the row beside the padding
    targets = tokens[:, 1:].clone()
    targets[1, 5] = -100
    return [(tokens[:, :-1].contiguous(), targets)]


def _run(family: str, preset: str, overrides: dict, **fields) -> TrainingRun:
    train = TrainConfig(seq_len=SEQ, batch=BATCH, chunk_tokens=7)
    overrides = {"vocab_size": VOCAB, **overrides, **fields}
    return TrainingRun.of(family, preset, train, overrides=overrides, keep_grads=True)


def _reference(family: str, preset: str, overrides: dict, state: dict):
    """The family's reference model in float64 with ``state``, and torch's AdamW over it
    (weight decay off where the family says, as the engine's)."""
    fam = load_family(family)
    config = fam.config(preset, vocab_size=VOCAB, **overrides)
    return float64_reference(fam, config, state, lr=LR)


def _stored(run: TrainingRun, kind: str) -> dict[str, torch.Tensor]:
    """Every ``kind`` object's tensors as the engine stores them (padded)."""
    layout = run.compiled.running.layout
    return {
        f"{p.layer}.{name}": view.clone()
        for p in layout.of_kind(kind)
        for name, view in p.layout.views(run._engine.fetch(p.id)).items()
    }


@pytest.mark.parametrize(("family", "preset", "overrides"), CASES, ids=IDS)
def test_the_step_stores_the_tables_padded_and_the_state_keeps_the_vocabulary(
    family, preset, overrides
) -> None:
    fam = load_family(family)
    config = fam.config(preset, vocab_size=VOCAB, **overrides)
    rows = state_rows(fam.layers(config))
    assert set(rows.values()) == {VOCAB} and len(rows) == (1 if family == "gpt2" else 2)
    embed = embed_layer(fam.layers(config)).params[0]
    assert embed.shape[0] == 320 and embed.state_shape[0] == VOCAB
    reference = fam.reference_model(config).state_dict()
    for layer in fam.layers(config):
        for p in layer.params:
            key = f"{layer.name}.{p.name}"
            if key in reference:
                assert tuple(reference[key].shape) == p.state_shape
    # 1 turns it off; a vocabulary already a multiple stores as it is
    for config in (fam.config(preset, vocab_size=VOCAB, vocab_multiple=1, **overrides),):
        assert state_rows(fam.layers(config)) == {}
        assert embed_layer(fam.layers(config)).params[0].shape[0] == VOCAB
    assert state_rows(fam.layers(fam.config(preset, vocab_size=320, **overrides))) == {}


@pytest.mark.parametrize(("family", "preset", "overrides"), CASES, ids=IDS)
def test_padded_steps_equal_the_unpadded_reference_model_and_padding_stays_zero(
    family, preset, overrides, tmp_path
) -> None:
    run = _run(family, preset, overrides)
    start, _ = run.state()
    assert run.vocab_size == VOCAB
    model, optim, named = _reference(family, preset, overrides, start)
    padded = state_rows(run.compiled.lowered.layers)
    for step in range(STEPS):
        batches = _batches(step)
        stats = run.step(batches, lr=LR)
        ((tokens, targets),) = batches
        optim.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        torch.testing.assert_close(torch.tensor(stats.loss).double(), loss, rtol=RTOL, atol=0)
        grads = run.grads()
        assert set(grads) == set(named)
        for name, param in named.items():
            assert grads[name].shape == param.shape, name  # the real vocabulary's
            torch.testing.assert_close(grads[name].double(), param.grad, rtol=RTOL, atol=ATOL)
        optim.step()
        # as stored: the padded rows of the weights, gradients and moments exactly zero
        stored = {**_stored(run, "W"), **_stored(run, "dW")}
        moments = _stored(run, "O")
        for key, rows in padded.items():
            layer, name = key.split(".", 1)
            assert stored[key].shape[0] == 320
            assert stored[key][rows:].count_nonzero() == 0, key
            for field in ("exp_avg", "exp_avg_sq"):
                assert moments[f"{layer}.{name}/{field}"][rows:].count_nonzero() == 0, key
    weights, _ = run.state()
    for name, param in named.items():
        assert weights[name].shape == param.shape, name
        torch.testing.assert_close(weights[name].double(), param.detach(), rtol=0, atol=WEIGHT_ATOL)
    # a checkpoint of the padded run holds the real vocabulary's shapes
    run.save(tmp_path / "step_000003")
    saved = load_file(str(tmp_path / "step_000003" / MODEL_FILE))
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }
    run.close()


@pytest.mark.parametrize(("family", "preset", "overrides"), CASES[:1], ids=IDS[:1])
def test_padded_and_unpadded_runs_train_the_same_real_rows(family, preset, overrides) -> None:
    """``vocab_multiple=1`` (no padding) against the default: the same losses and weights
    to float32 rounding of the logits matmul's other width."""
    runs = [_run(family, preset, overrides, vocab_multiple=m) for m in (64, 1)]
    losses = [[run.step(_batches(step), lr=LR).loss for step in range(STEPS)] for run in runs]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-6, atol=0)
    (padded, padded_opt), (plain, plain_opt) = (run.state() for run in runs)
    assert {k: v.shape for k, v in padded.items()} == {k: v.shape for k, v in plain.items()}
    for name in plain:
        torch.testing.assert_close(padded[name], plain[name], rtol=0, atol=WEIGHT_ATOL)
    # the optimizer state leaves the step laid out for the real vocabulary too (what a
    # checkpoint keeps): the padded run's state goes on in an unpadded step, and back
    assert {k: v.shape for k, v in padded_opt.items()} == {k: v.shape for k, v in plain_opt.items()}
    for run, (weights, opt) in zip(runs, ((plain, plain_opt), (padded, padded_opt)), strict=True):
        run.set_state(weights, opt, STEPS)
    after = [run.step(_batches(STEPS), lr=LR).loss for run in runs]
    torch.testing.assert_close(after[0], after[1], rtol=1e-6, atol=0)
    for run in runs:
        run.close()
