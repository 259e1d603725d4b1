"""``TrainConfig.head_vocab_tiles``: the head task asks its kernel for the weight gradient
tile by tile, is priced for the extra logits matmul, and trains as the chunk-summed head
does (bfloat16 on the CPU, where the torch kernel variant runs both paths)."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.lowering import lower

pytest.importorskip("dataflow_family_llama3")

PRESET = "llama3_tiny"


def _train(tiles: bool) -> TrainConfig:
    # 2 x 16 tokens a round in chunks of 8: four chunks, so the tiles are used
    return TrainConfig(
        seq_len=16,
        batch=2,
        rounds=2,
        chunk_tokens=8,
        dtype=DtypePolicy.named("bf16"),
        head_vocab_tiles=tiles,
    )


def _heads(tiles: bool) -> list:
    from dataflow_training.step.family import load_family

    program = lower(load_family("llama3"), PRESET, _train(tiles)).program
    return [task for task in program.tasks if task.kind == "head"]


def test_the_head_task_asks_for_tiles_and_is_priced_for_them() -> None:
    plain, tiled = _heads(False), _heads(True)
    assert all("vocab_tiles" not in task.params for task in plain)
    assert all(task.params["vocab_tiles"] is True for task in tiled)
    assert all(b.cost_us > a.cost_us for a, b in zip(plain, tiled, strict=True))


def test_a_tiled_head_trains_as_the_chunk_summed_one(monkeypatch) -> None:
    """Three bf16 steps each way from the same weights and tokens: the losses within
    2e-2 (relative), every weight within bf16's step tolerance; and the tiled run's kernel
    was asked for tiles in every head task."""
    from dataflow_kernels_torch import cross_entropy
    from dataflow_training.drive.run import TrainingRun

    asked = []
    fast = cross_entropy.chunked_cross_entropy

    def spy(*args, **kwargs):
        asked.append(kwargs.get("vocab_tiles", False))
        return fast(*args, **kwargs)

    monkeypatch.setattr(cross_entropy, "chunked_cross_entropy", spy)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        rounds = []
        for _ in range(2):
            tokens = torch.randint(0, 256, (2, 16), generator=g)
            rounds.append((tokens, torch.randint(0, 256, (2, 16), generator=g)))
        batches.append(rounds)
    results = {}
    for tiles in (False, True):
        run = TrainingRun.of("llama3", PRESET, _train(tiles), device="cpu", seed=0)
        asked.clear()  # the profiling pass launched the head too
        losses = [run.step(rounds).loss for rounds in batches]
        weights, _ = run.state()
        run.close(keep_state=False)
        results[tiles] = losses, weights
        assert asked == [tiles] * 6  # 2 rounds x 3 steps
    (plain_losses, plain_w), (tiled_losses, tiled_w) = results[False], results[True]
    torch.testing.assert_close(
        torch.tensor(tiled_losses), torch.tensor(plain_losses), rtol=2e-2, atol=0
    )
    for name, value in plain_w.items():
        torch.testing.assert_close(tiled_w[name].float(), value.float(), rtol=2e-2, atol=2e-2)
