"""``TrainConfig.vocab_pieces`` (``step.pieces``): the vocabulary tables stored and
updated in row pieces train as the whole tables do, each update holding one piece."""

from __future__ import annotations

import pytest
import torch
from dataflow_training import TrainingRun
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.family import RowGradient, RowPieces, load_family
from dataflow_training.step.lowering import lower
from dataflow_training.step.precision import for_optimizer

pytest.importorskip("dataflow_family_llama3")

UNTIED = {"tie_word_embeddings": False}


def _train(pieces: int, dtype: str = "fp32", **fields) -> TrainConfig:
    return TrainConfig(
        seq_len=16,
        batch=2,
        rounds=2,
        chunk_tokens=8,
        dtype=DtypePolicy.named(dtype),
        vocab_pieces=pieces,
        **fields,
    )


def test_each_table_is_four_groups_each_updated_alone() -> None:
    step = lower(load_family("llama3"), "llama3_tiny", _train(4), overrides=UNTIED)
    program = step.program
    objects = {o.id: o.size_bytes for o in program.objects}
    for layer in ("emb", "head"):
        for kind in ("W", "dW", "O"):
            assert all(f"{kind}_{layer}.vocab.{j}" in objects for j in range(4))
    whole = lower(load_family("llama3"), "llama3_tiny", _train(1), overrides=UNTIED).program
    sizes = {o.id: o.size_bytes for o in whole.objects}
    assert objects["W_emb.vocab.0"] * 4 == sizes["W_emb"]
    assert "W_head" in objects and objects["W_head"] < sizes["W_head"] / 4  # the norm alone
    updates = [t for t in program.tasks if t.kind == "opt" and ".vocab." in t.id]
    assert len(updates) == 8
    for task in updates:  # one piece's weights, gradient and state: a quarter of the table's
        held = sum(objects[o] for o in (*task.inputs, *task.mutates, *task.outputs))
        whole_update = sizes["W_emb"] + sizes["dW_emb"] + sizes["O_emb"]
        assert held * 4 == whole_update
    embed = next(t for t in program.tasks if t.kind == "embed")
    assert embed.inputs[1:] == tuple(f"W_emb.vocab.{j}" for j in range(4))


def test_one_piece_is_the_step_as_before_the_field() -> None:
    step = lower(load_family("llama3"), "llama3_tiny", _train(1))
    assert "vocab_pieces" not in step.program.to_json()
    assert not any(".vocab." in o.id for o in step.program.objects)


@pytest.mark.parametrize(("overrides", "dtype"), [(UNTIED, "fp32"), (UNTIED, "bf16"), ({}, "bf16")])
def test_pieces_train_as_the_whole_tables(overrides, dtype) -> None:
    """Three steps from the same weights and tokens, whole and in four pieces: float32
    losses and weights within 1e-6 (the same arithmetic, the pieces' logits written into
    one buffer), bf16 within one bf16 step; the tied table too (the head reads the
    embedding's pieces and its gradient flows into them)."""
    from dataflow_training.drive.run import TrainingRun

    g = torch.Generator().manual_seed(0)
    batches = [
        [tuple(torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)) for _ in range(2)]
        for _ in range(3)
    ]
    results = {}
    for pieces in (1, 4):
        run = TrainingRun.of(
            "llama3", "llama3_tiny", _train(pieces, dtype), device="cpu", seed=0,
            overrides=overrides,
        )  # fmt: skip
        losses = [run.step(rounds).loss for rounds in batches]
        weights, _ = run.state()
        run.close(keep_state=False)
        results[pieces] = losses, weights
    (losses, weights), (p_losses, p_weights) = results[1], results[4]
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(torch.tensor(p_losses), torch.tensor(losses), **tolerance)
    assert sorted(p_weights) == sorted(weights)
    for name, value in weights.items():
        assert p_weights[name].shape == value.shape, name  # whole tables in the state
        torch.testing.assert_close(p_weights[name].float(), value.float(), **tolerance)


def test_row_pieces_gather_as_the_table() -> None:
    table = torch.randn(12, 3)
    index = torch.tensor([[0, 11, 5], [3, 4, 4]])
    pieces = RowPieces(table.split(4))
    assert pieces.shape == (12, 3) and pieces.dtype == table.dtype
    assert torch.equal(pieces[index], table[index])


@pytest.mark.parametrize("add", [False, True])
def test_a_row_gradient_writes_each_piece_its_rows(add) -> None:
    """Every piece written from the whole table's RowGradient (rows repeating, some
    pieces with no row at all) holds its rows of the dense result, rounded once."""
    rows = torch.tensor([1, 1, 2, 9, 9, 9])
    values = torch.randn(6, 3, dtype=torch.float64)
    grad = RowGradient.summed(rows, values, (12, 3), torch.float32)
    start = torch.randn(12, 3).to(torch.bfloat16)
    dense = start.clone() if add else torch.zeros(12, 3, dtype=torch.bfloat16)
    (grad.add_into if add else grad.copy_into)(dense)
    pieces = [p.clone() for p in start.split(4)]
    for j, piece in enumerate(pieces):
        (grad.add_into if add else grad.copy_into)(piece, 4 * j)
    assert torch.equal(torch.cat(pieces), dense)


def test_pieces_that_do_not_fit_the_table_are_refused() -> None:
    family = load_family("llama3")
    with pytest.raises(ValueError, match=r"vocab_pieces=3 must divide the vocabulary's 256"):
        lower(family, "llama3_tiny", _train(3))
    adafactor = for_optimizer("fp32", "adafactor").optimizer_policy("adafactor")
    with pytest.raises(ValueError, match="element by element"):  # factored moments
        lower(family, "llama3_tiny", _train(2, optimizer=adafactor))
    with pytest.raises(ValueError, match="without padding rows"):
        lower(family, "llama3_tiny", _train(2), overrides={"vocab_size": 250})


def _run(pieces: int) -> TrainingRun:
    config = TrainConfig(seq_len=16, batch=2, rounds=1, dtype=DtypePolicy(), vocab_pieces=pieces)
    return TrainingRun.of("llama3", "llama3_tiny", config, budget_bytes=None, device="cpu", seed=1)


@pytest.mark.parametrize("after", [4, 1])
def test_a_resume_in_other_pieces_cuts_the_optimizer_state_again(after, tmp_path) -> None:
    """Two steps in two pieces, checkpointed, then a third in ``after`` pieces: the same
    bits as three steps in two (the optimizer state joined by rows and cut again,
    ``values.recut_opt``; float32 on the CPU, where pieces train bitwise as whole tables)."""
    generator = torch.Generator().manual_seed(0)
    data = [[(torch.randint(0, 256, (2, 16), generator=generator),) * 2] for _ in range(3)]
    straight = _run(2)
    losses = [straight.step(batch).loss for batch in data]
    first = _run(2)
    for batch in data[:2]:
        first.step(batch)
    first.save(tmp_path / "ck")
    first.close()
    resumed = _run(after)
    resumed.restore(tmp_path / "ck")
    assert resumed.step(data[2]).loss == losses[2]
    ours, theirs = resumed.state()[0], straight.state()[0]
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
