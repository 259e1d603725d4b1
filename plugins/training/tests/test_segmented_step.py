"""A lowered step with segments (``TrainConfig(segments=True)``, issue 49 item 3): each
round's ``S_s_r`` object read by the block tasks, ``TrainingRun.step`` fed ``(tokens,
targets, segments)``, and the families whose attention takes none refused at lowering.

Held to an independent plain-autograd reference: llama3_tiny's reference model in
float64 run on each document (or each padded row's real tokens) apart, from position 0,
its loss the mean cross-entropy over the round's scored tokens (a document's last token
predicts nothing), averaged over the rounds as the step does. The engine runs float32:
the loss and every gradient agree to ``RTOL``/``ATOL`` (float32 through two layers; the
segmented attention's per-row kernel sums in another order), and the weights after the
AdamW updates to ``WEIGHT_ATOL``.

A step without segments is unchanged, byte for byte: the SHA-256 of each program's JSON
below was taken from main before ``TrainConfig.segments`` existed."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.drive.run import TrainingRun
from dataflow_training.kit import IGNORE_INDEX, Segments
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import Lowered, lower
from dataflow_training.testing import float64_reference

from dataflow import Program

pytest.importorskip("dataflow_family_llama3")
pytest.importorskip("dataflow_kernels_torch")

PRESET = "llama3_tiny"
BATCH, SEQ, ROUNDS, STEPS = 2, 16, 2, 2
LR = 1e-3
#: float32 engine against the float64 reference: the loss and every gradient
RTOL, ATOL = 1e-4, 1e-6
#: weights after STEPS AdamW updates: each moves a weight by about LR at most, and Adam
#: divides a gradient near zero by its own size, so float32 rounding of one (a token row
#: few documents use) moves its update by a few percent of LR
WEIGHT_ATOL = 5e-5

#: (family, preset, TrainConfig fields, overrides, lower keywords) -> the SHA-256 of the
#: program's JSON, taken from main before segments existed
UNCHANGED = [
    (
        ("llama3", "llama3_tiny", {"seq_len": 16, "batch": 2, "rounds": 2}, {}, {}),
        "476bf198d674cae1cd0953189c7d7419ea89f41bbdc1c4911becab05b47d2827",
    ),
    (
        (
            "llama3",
            "llama3_tiny",
            {"seq_len": 16, "batch": 2, "rounds": 3, "order": "layer", "clip": 1.0},
            {},
            {"recompute": [0]},
        ),
        "5a0eea5ecd6e0c1303f6a84a7ad6213b46aa4815ae2b6551935ae78b669690f0",
    ),
    (
        (
            "llama3",
            "llama3_tiny",
            {"seq_len": 16, "rounds": 2, "freeze": ("embed",)},
            {},
            {"partial": {1: "mlp"}},
        ),
        "904eda4a13dc3127f020c22fe01d9bb1742fba14d80ab7ad3d53d6de07c2bddc",
    ),
    (
        ("gpt2", "gpt2_tiny", {"seq_len": 16, "batch": 2, "rounds": 2, "order": "layer:1"}, {}, {}),
        "060736ccec96f6e68592aa517c478b5708782d9e372de1f625dfa0afc0dc1b81",
    ),
    (
        ("olmoe", "olmoe_tiny", {"seq_len": 8, "rounds": 2}, {"expert_shards": 2}, {}),
        "8cf2825f88fff43fd24f2d138025901d9d08764e7221bb1d4ecc55bb5aa3e2b1",
    ),
    (
        ("qwen3_5", "qwen3_5_tiny", {"seq_len": 8, "rounds": 2}, {}, {}),
        "6b8aa71d175136c6f3ba7d2dff8a91bd3d880c0ed3180129a4e880171f0e2df5",
    ),
]


@pytest.mark.parametrize(("case", "digest"), UNCHANGED, ids=[c[0][1] for c in UNCHANGED])
def test_a_step_without_segments_is_unchanged_byte_for_byte(case, digest) -> None:
    family, preset, fields, overrides, keywords = case
    pytest.importorskip(f"dataflow_family_{family}")
    program = lower(
        load_family(family), preset, TrainConfig(**fields), overrides=overrides, **keywords
    ).program
    assert hashlib.sha256(program.to_json().encode()).hexdigest() == digest
    assert not any(o.id.startswith("S_") for o in program.objects)


def test_the_segments_object_is_read_by_every_block_task_that_attends() -> None:
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS, segments=True)
    step = lower(load_family("llama3"), PRESET, train, recompute=[(1, 0)], partial={(0, 1): "mlp"})
    objects = {o.id: o for o in step.program.objects}
    for r in range(ROUNDS):
        s = objects[f"S_0_{r}"]
        assert s.role == "data" and s.tensor.dtype == "int64"
        assert s.tensor.shape == (2, BATCH, SEQ)
    readers = {t.id for t in step.program.tasks if any(i.startswith("S_") for i in t.inputs)}
    # every forward, the full recompute, every backward; not embed, head, nor the partial
    # save's rec (it re-derives the FFN from h_mid)
    assert readers == {
        *(f"{kind}_0_{r}_{i}" for kind in ("fwd", "bwd") for r in range(ROUNDS) for i in (0, 1)),
        "rec_0_1_0",
    }
    rec = step.layout.tasks["rec_0_0_1"]
    assert rec.kind == "rec" and "segments" not in rec.inputs
    assert step.layout.data_objects()["S_0_1"] == (1, "segments")
    # a program written out keeps its segments
    read = Lowered.read(Program.from_json(step.program.to_json()))
    assert read.layout.train.segments is True


def test_a_routed_block_apart_reads_them_in_its_routing_tasks_only() -> None:
    pytest.importorskip("dataflow_family_olmoe")
    train = TrainConfig(seq_len=8, segments=True)
    step = lower(load_family("olmoe"), "olmoe_tiny", train, overrides={"expert_shards": 2})
    readers = {t.kind for t in step.program.tasks if "S_0_0" in t.inputs}
    assert readers == {"fwd", "bwd"}


@pytest.mark.parametrize(
    ("family", "preset", "message"),
    [
        ("gpt2", "gpt2_tiny", r"family 'gpt2': 'block' takes no segments .*FusedQKVAttention"),
        (
            "qwen3_5",
            "qwen3_5_tiny",
            r"family 'qwen3_5': 'linear_block' takes no segments .*GatedDeltaNet does not$",
        ),
        ("deepseek_v3", "deepseek_v3_tiny", r"family 'deepseek_v3': '\w+' takes no segments"),
    ],
)
def test_a_family_whose_attention_takes_none_is_refused_in_one_line(
    family, preset, message
) -> None:
    pytest.importorskip(f"dataflow_family_{family.split('_v')[0]}")
    with pytest.raises(ValueError, match=message) as caught:
        lower(load_family(family), preset, TrainConfig(seq_len=8, segments=True))
    assert "\n" not in str(caught.value)


# -- the numbers ---------------------------------------------------------------------------


def _packed(step: int, r: int) -> tuple[torch.Tensor, Segments, list[tuple[int, int, int]]]:
    """Round ``r`` of ``step``: rows packed with documents of several lengths (one of one
    token, one filling a row), the last row's tail padding; -> (tokens, segments, the
    documents as (row, start, end))."""
    g = torch.Generator().manual_seed(1000 * step + r)
    lengths = [[5, 1, 7, 3], [9, 4]] if (step + r) % 2 == 0 else [[SEQ], [2, 6, 5]]
    docs = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            docs.append((row, start, start + length))
            start += length
    vocab = load_family("llama3").config(PRESET).vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    segments = _segments_of(docs)
    return tokens, segments, docs


def _segments_of(docs: list[tuple[int, int, int]]) -> Segments:
    ids = torch.full((BATCH, SEQ), -1, dtype=torch.int64)
    positions = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for i, (row, start, end) in enumerate(docs):
        ids[row, start:end] = i
        positions[row, start:end] = torch.arange(end - start)
    return Segments(ids, positions)


def _padded(step: int, r: int) -> tuple[torch.Tensor, Segments, list[tuple[int, int, int]]]:
    """Round ``r`` of ``step``: one row padded on the left, one on the right (HF's
    attention_mask), one sequence a row."""
    g = torch.Generator().manual_seed(2000 * step + r)
    vocab = load_family("llama3").config(PRESET).vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    left, right = 3 + r, 5 - step
    mask[0, :left] = 0
    mask[1, SEQ - right :] = 0
    segments = Segments.from_attention_mask(mask)
    return tokens, segments, [(0, left, SEQ), (1, 0, SEQ - right)]


def _reference_loss(model, rounds) -> torch.Tensor:
    """The mean over rounds of each round's mean cross-entropy over its documents' scored
    tokens, each document run apart from position 0."""
    losses = []
    for tokens, _segments, docs in rounds:
        total, count = 0.0, 0
        for row, start, end in docs:
            doc = tokens[row, start:end][None]
            if doc.shape[1] < 2:
                continue  # a one-token document predicts nothing
            logits = model.logits(doc)[0, :-1]
            total = total + F.cross_entropy(logits, doc[0, 1:], reduction="sum")
            count += doc.shape[1] - 1
        losses.append(total / count)
    return torch.stack(losses).mean()


def _reference(state):
    family = load_family("llama3")
    return float64_reference(family, family.config(PRESET), state, lr=LR)


@pytest.mark.parametrize("make", [_packed, _padded], ids=["packed", "padded"])
@pytest.mark.parametrize("order", ["round", "layer"])
def test_a_segmented_step_equals_autograd_of_the_reference_run_per_document(make, order) -> None:
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS, order=order, segments=True)
    # block 1 of round 0 re-derived whole: its recompute reads the segments too
    run = TrainingRun.of("llama3", PRESET, train, keep_grads=True, recompute=False)
    start, _ = run.state()
    model, optim, named = _reference(start)
    for step in range(STEPS):
        rounds = [make(step, r) for r in range(ROUNDS)]
        for tokens, segments, _ in rounds:
            targets = segments.targets(tokens)
            assert (targets == IGNORE_INDEX).any()
        stats = run.step([(t, s.targets(t), s) for t, s, _ in rounds], lr=LR)
        optim.zero_grad()
        loss = _reference_loss(model, rounds)
        loss.backward()
        torch.testing.assert_close(torch.tensor(stats.loss).double(), loss, rtol=RTOL, atol=0)
        grads = run.grads()
        assert set(grads) == set(named)
        for name, param in named.items():
            torch.testing.assert_close(
                grads[name].double(), param.grad, rtol=RTOL, atol=ATOL, msg=name
            )
        optim.step()
    weights, _ = run.state()
    for name, param in named.items():
        torch.testing.assert_close(weights[name].double(), param.detach(), rtol=0, atol=WEIGHT_ATOL)
    run.close()


def test_a_step_that_recomputes_its_blocks_reads_the_segments_again() -> None:
    """Planned into 90% of its unbounded peak, the step re-derives every block before
    its backward (the recompute planner's choice): the recompute runs the segmented
    attention again, and the gradients are still the reference's."""
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS, segments=True)
    peak = compile_step("llama3", PRESET, train, cost=RooflineCost()).predicted()
    compiled = compile_step(
        "llama3",
        PRESET,
        train,
        budget_bytes=int(0.9 * peak["fast_peak_bytes"]),
        cost=RooflineCost(),
        keep_grads=True,
    )
    recomputes = [t for t in compiled.running.program.tasks if t.kind == "rec"]
    assert recomputes and all(
        "partial" not in t.params and f"S_0_{t.params['round']}" in t.inputs for t in recomputes
    )
    run = TrainingRun(compiled)
    start, _ = run.state()
    model, _, named = _reference(start)
    rounds = [_packed(0, r) for r in range(ROUNDS)]
    stats = run.step([(t, s.targets(t), s) for t, s, _ in rounds], lr=LR)
    loss = _reference_loss(model, rounds)
    loss.backward()
    torch.testing.assert_close(torch.tensor(stats.loss).double(), loss, rtol=RTOL, atol=0)
    grads = run.grads()
    for name, param in named.items():
        torch.testing.assert_close(grads[name].double(), param.grad, rtol=RTOL, atol=ATOL, msg=name)
    run.close()


def test_the_step_checks_the_segments_it_is_fed() -> None:
    train = TrainConfig(seq_len=SEQ, batch=BATCH, segments=True)
    run = TrainingRun.of("llama3", PRESET, train, recompute=False)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    wrong = Segments.dense(BATCH, SEQ - 1)
    with pytest.raises(ValueError, match=r"round 0 segments have shape \(2, 15\)"):
        run.step([(tokens, tokens, wrong)])
    with pytest.raises(ValueError, match="round 0 segments are a Tensor"):
        run.step([(tokens, tokens, torch.zeros(2, BATCH, SEQ))])
    plain = TrainingRun.of("llama3", PRESET, TrainConfig(seq_len=SEQ, batch=BATCH))
    with pytest.raises(ValueError, match="lowered without them"):
        plain.step([(tokens, tokens, Segments.dense(BATCH, SEQ))])
    # None (or no third value) is one sequence a row: the dense step's numbers
    dense = plain.step([(tokens, tokens)], lr=LR)
    assert run.step([(tokens, tokens, None)], lr=LR).loss == pytest.approx(dense.loss, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_packed, _padded], ids=["packed", "padded"])
def test_a_segmented_step_on_cuda_equals_the_reference(make) -> None:
    """On CUDA, in float32, in layer order, replayed from a CUDA graph from the second
    step on (the segments' views are taken without a sync, so the step captures): the
    segmented attention's CUDA path (the memory-efficient kernel's per-row bias) against
    the same float64 reference. Tolerances: rtol 1e-3 (another kernel's summation order
    in float32, TF32 off as torch leaves it), atol 1e-5."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    train = TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS, order="layer", segments=True)
    run = TrainingRun.of(
        "llama3", PRESET, train, device="cuda", budget_bytes=48 * 2**20, keep_grads=True
    )
    start, _ = run.state()
    model, optim, named = _reference(start)
    for step in range(3):
        rounds = [make(step, r) for r in range(ROUNDS)]
        stats = run.step([(t, s.targets(t), s) for t, s, _ in rounds], lr=LR)
        optim.zero_grad()
        loss = _reference_loss(model, rounds)
        loss.backward()
        torch.testing.assert_close(torch.tensor(stats.loss).double(), loss, rtol=1e-3, atol=0)
        grads = run.grads()
        for name, param in named.items():
            torch.testing.assert_close(
                grads[name].double(), param.grad, rtol=1e-3, atol=1e-5, msg=name
            )
        optim.step()
    assert run.graph_note is None, run.graph_note  # the later steps replayed the graph
    run.close()
