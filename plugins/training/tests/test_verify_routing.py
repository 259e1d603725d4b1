"""``routing_checks``: the bf16 MoE step check routes the float64 reference with the
engine's recorded expert choices, and this check holds those choices to the reference's
own top-k up to near ties, and the recorded weights to the reference's probabilities."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dataflow_training.check.verify import routing_checks
from dataflow_training.drive.run import TrainingRun
from dataflow_training.step.config import TrainConfig


def _case(logits: torch.Tensor, ids: torch.Tensor, *, norm: bool = False, weights=None):
    """One step of one round of one layer "0": the engine chose ``ids``."""
    probs = torch.softmax(logits.double(), -1)
    if weights is None:
        weights = probs.gather(1, ids)
        if norm:
            weights = weights / weights.sum(-1, keepdim=True)
    config = SimpleNamespace(num_experts_per_tok=ids.shape[1], norm_topk_prob=norm)
    engine = [[{"0": {"ids": ids.int(), "weights": weights.float()}}]]
    return config, engine, [[[(logits, ids)]]]


def _logits() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_the_reference_top_k_passes_with_no_differing_choice() -> None:
    logits = _logits()
    for norm in (False, True):
        config, engine, ref = _case(logits, logits.topk(2, -1).indices, norm=norm)
        routing, weights = routing_checks(config, engine, ref, 1e-4)
        assert routing.name.startswith("routing 0: 0 of 6 ") and routing.rel == 0 and routing.ok
        assert weights.ok and weights.rel < 1e-6


def test_a_near_tie_taken_the_other_way_is_counted_and_held_to_the_tolerance() -> None:
    logits = _logits()
    order = logits[0].argsort(descending=True)
    logits[0, order[2]] = logits[0, order[1]] - 1e-3  # 2nd and 3rd 0.1 % apart
    ids = logits.topk(2, -1).indices
    ids[0, 1] = order[2]  # the engine took the 3rd in place of the 2nd
    config, engine, ref = _case(logits, ids)
    routing, _ = routing_checks(config, engine, ref, 5e-2)
    assert routing.name.startswith("routing 0: 1 of 6 ")
    assert 5e-4 < routing.rel < 2e-3 and routing.ok
    assert not routing_checks(config, engine, ref, 1e-4)[0].ok


def test_a_wrong_choice_or_wrong_weights_fail() -> None:
    logits = _logits()
    ids = logits.topk(2, -1).indices
    ids[3, 0] = logits[3].argmin()  # the least likely expert: no near tie
    config, engine, ref = _case(logits, ids)
    assert not routing_checks(config, engine, ref, 5e-2)[0].ok
    good = logits.topk(2, -1).indices
    raw = torch.softmax(logits, -1).gather(1, good)
    config, engine, ref = _case(logits, good, norm=True, weights=raw)  # not renormalised
    routing, weights = routing_checks(config, engine, ref, 5e-2)
    assert routing.ok and not weights.ok


def test_a_run_keeps_its_aux_temp_per_round_and_layer_only_when_asked() -> None:
    """``TrainingRun.of(keep_aux_temp=True).aux_temps()``: each round's recorded routing,
    per layer (the same batch twice: the same choices); without it, an error naming the
    option."""
    pytest.importorskip("dataflow_resolver_torch")  # the run executes its tasks
    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 41, (2, 8), generator=g) for _ in range(2))] * 2
    with TrainingRun.of("toy_moe", "toy_moe_tiny", train, keep_aux_temp=True) as run:
        run.step(batches)
        rounds = run.aux_temps()
        blocks = [layer.name for layer in run.compiled.layout.layers if layer.kind == "moe"]
    assert len(rounds) == 2 and all(list(r) == blocks for r in rounds) and blocks
    k = run.compiled.config.top_k
    assert all(t["ids"].shape == (16, k) for r in rounds for t in r.values())
    assert torch.equal(rounds[0][blocks[0]]["ids"], rounds[1][blocks[0]]["ids"])
    with TrainingRun.of("toy_moe", "toy_moe_tiny", train) as run:
        run.step(batches)
        with pytest.raises(RuntimeError, match="keep_aux_temp=True"):
            run.aux_temps()
