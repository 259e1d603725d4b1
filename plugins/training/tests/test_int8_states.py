"""``--optimizer-states int8``: AdamW's moments block-wise in 8 bits (``optim.blockwise8``,
``optim.adamw_int8``).

- the round trip keeps every value within the map's relative error (4.7 %) or half its
  floor of the block's largest (a second moment: the floor, never 0 unless it is 0), the
  largest exactly;
- the engine's update equals a float64 AdamW on the plain-autograd reference model's
  gradients, its moments quantized by an independent quantizer of the test's own (a
  table of the map's values searched for the nearest in the logarithm);
- 50 steps of gpt2_tiny follow the fp32-moment run's losses;
- a resumed run repeats the straight run's losses bit for bit; a resume at other states
  is refused naming the field;
- the state objects are priced exactly, and predict shows the host bytes they free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dataflow_training.optim import blockwise8
from dataflow_training.optim.int8_blocks import BLOCK, blocks
from dataflow_training.step.config import INT8_STATES, TrainConfig, optimizer_states

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

SIGNED = (blockwise8.SIGNED_TOP, blockwise8.SIGNED_FLOOR)
UNSIGNED = (blockwise8.UNSIGNED_TOP, blockwise8.UNSIGNED_FLOOR)


def _roundtrip(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(value.shape, dtype=dtype)
    scales = torch.empty(blocks(value.numel()))
    blockwise8.quantize_(value, codes, scales)
    return blockwise8.dequantize(codes, scales), codes


def _block_absmax(value: torch.Tensor) -> torch.Tensor:
    """Each element's block's largest magnitude, elementwise."""
    flat = value.reshape(-1).abs()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    return padded.amax(1).repeat_interleave(BLOCK)[: flat.numel()].view(value.shape)


@pytest.mark.parametrize("shape", [(1000,), (3, 256), (7, 37), (5,)])
@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_the_round_trip_keeps_each_value_within_the_map_s_error(shape, signed) -> None:
    g = torch.Generator().manual_seed(0)
    # magnitudes over 12 decades, so some fall under the floor and turn to 0
    value = torch.randn(shape, generator=g) * torch.logspace(-12, 0, math.prod(shape)).view(shape)
    if not signed:
        value = value.square()  # over 24 decades, as a second moment's are the first's squared
    top, floor = SIGNED if signed else UNSIGNED
    back, codes = _roundtrip(value, torch.int8 if signed else torch.uint8)
    absmax = _block_absmax(value)
    under = floor / 2 if signed else floor  # a second moment under the floor is raised to it
    bound = blockwise8.relative_error(top, floor) * value.abs() + under * absmax
    assert ((back - value).abs() <= bound * (1 + 1e-5) + 1e-30).all()
    assert blockwise8.relative_error(top, floor) < 0.047
    largest = value.abs() == absmax
    assert torch.equal(back[largest], value[largest])  # the block's largest is its scale
    if signed:
        assert (back == 0).any() and (back != 0).any()
    else:  # raised, not zeroed: the update divides by its root
        assert torch.equal(back == 0, value == 0) and (back >= value * (1 - 0.047)).all()
        raised = (value > 0) & (value < floor * absmax)
        assert raised.any()
        torch.testing.assert_close(back[raised], floor * absmax[raised], rtol=1e-5, atol=0)
    assert torch.equal(back.sign(), torch.where(back == 0, 0.0, value.sign()))
    assert codes.abs().max() == top if signed else codes.max() == top


def test_an_all_zero_block_stays_zero() -> None:
    value = torch.cat([torch.zeros(BLOCK), torch.ones(10)])
    back, _ = _roundtrip(value, torch.int8)
    assert torch.equal(back, value)


# -- an independent quantizer: the map's values as a table, nearest in the logarithm ----


def _table(top: int, floor: float) -> torch.Tensor:
    """Code magnitude k -> value (float64), from the map's definition: code ``top`` is 1,
    each code below it ``floor ** (1 / (top - 1))`` times the one above, code 0 is 0."""
    ratio = floor ** (1 / (top - 1))
    return torch.tensor([0.0] + [ratio ** (top - k) for k in range(1, top + 1)])


def _reference_codes(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as int64, scales) of ``value`` (float64): per block of ``BLOCK`` its largest
    magnitude; each magnitude / scale to the table entry nearest in the logarithm (the
    boundaries are the geometric means of neighbours); under the floor, 0 below half of it
    (signed) or the floor unless it is 0 (unsigned)."""
    top, floor = SIGNED if signed else UNSIGNED
    table = _table(top, floor)
    flat = value.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    scales = padded.abs().amax(1)
    unit = (padded.abs() / scales.clamp_min(1e-300).unsqueeze(1)).reshape(-1)
    zero_below = floor / 2 if signed else 1e-300
    bounds = torch.cat(
        [torch.tensor([zero_below], dtype=torch.float64), (table[1:-1] * table[2:]).sqrt()]
    )
    codes = torch.searchsorted(bounds, unit, right=True)
    if signed:
        codes = codes * padded.reshape(-1).sign().long()
    return codes[: flat.numel()].view(value.shape), scales


def _reference_value(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    table = _table(*(SIGNED if signed else UNSIGNED))
    flat = codes.reshape(-1)
    unit = table[flat.abs()] * flat.sign()
    padded = torch.nn.functional.pad(unit, (0, -unit.numel() % BLOCK)).view(-1, BLOCK)
    return (padded * scales.unsqueeze(1)).reshape(-1)[: flat.numel()].view(codes.shape)


def test_the_independent_quantizer_agrees_with_blockwise8() -> None:
    """The two quantizers pick the same codes (one code off only at a boundary that
    float32 and float64 place differently: at most 1 in 1000 elements)."""
    g = torch.Generator().manual_seed(1)
    value = torch.randn(4096, generator=g, dtype=torch.float64) * torch.logspace(-6, 0, 4096)
    for signed, dtype in ((True, torch.int8), (False, torch.uint8)):
        v = value if signed else value.square()
        _, codes = _roundtrip(v.float(), dtype)
        ref, _ = _reference_codes(v, signed)
        off = (codes.long() - ref).abs()
        assert off.max() <= 1 and (off > 0).float().mean() <= 1e-3


# -- the engine's update against plain autograd and a float64 AdamW ----------------------


def _states(run) -> dict[str, torch.Tensor]:
    """``{"<layer>.<param>/<field>": tensor}`` of the run's optimizer state."""
    layout = run.compiled.running.layout
    fields = {}
    for obj_id, raw in run.state()[1].items():
        packed = layout.packed[obj_id]
        for name, view in packed.layout.views(raw).items():
            fields[f"{packed.layer}.{name}"] = view.clone()
    return fields


def test_each_update_is_float64_adamw_with_independently_quantized_moments() -> None:
    """Four steps of gpt2_tiny (two rounds) with int8 moments. Each step from the engine's
    own weights and moments (its codes read back through the test's table): the plain
    autograd reference's float64 gradients, a float64 AdamW step (``torch.optim.AdamW``'s
    formula, written out), the new moments quantized by the test's quantizer. Each weight
    after each step agrees within 2e-6 + 1e-5 relative (float32 against float64
    arithmetic; the update moves weights by up to lr = 1e-2) plus what the engine's float32
    gradient makes AdamW's update differ by (``adam_update_gap``, the allowance of
    ``dataflow verify``: large only where a gradient is as small as its rounding); the
    codes agree but where the engine's float32 moment and the reference's float64 one
    fall on two sides of a code boundary (one code apart, at most 1 in 100 elements, or
    anywhere under the floor, where a gradient that is exactly 0 in float64 and rounding
    noise in float32, as a key bias's, decides between 0 and the floor),
    and every moment the engine keeps is within the map's rounding (``relative_error``,
    half the floor) plus what the gradients' difference moves it by (and 1e-4 of that for
    float32's own rounding of the log and the moment); the scales within 1e-4 relative."""
    from dataflow_training.check.tolerances import adam_update_gap
    from dataflow_training.check.verify_step import Reference
    from dataflow_training.drive.run import TrainingRun

    policy = optimizer_states("int8", lr=1e-2)
    train = TrainConfig(seq_len=8, batch=2, rounds=2, optimizer=policy)
    g = torch.Generator().manual_seed(3)
    with TrainingRun.of("gpt2", "gpt2_tiny", train, seed=0, keep_grads=True) as run:
        reference = Reference(run.compiled.family, run.compiled.config, train)
        beta1, beta2, eps, lr = policy.beta1, policy.beta2, policy.eps, policy.lr
        names = list(reference.named)
        moved = 0.0
        for step in range(1, 5):
            weights = {k: v.double() for k, v in run.state()[0].items()}
            states = _states(run)
            batches = [
                (
                    torch.randint(0, 256, (2, 8), generator=g),
                    torch.randint(0, 256, (2, 8), generator=g),
                )
                for _ in range(2)
            ]
            grads = reference.grads(weights, batches).grads
            run.step(batches)
            after, new, engine_grads = run.state()[0], _states(run), run.grads()
            for name in names:
                m = _reference_value(
                    states[f"{name}/exp_avg"].long(), states[f"{name}/exp_avg_scale"].double(), True
                )
                v = _reference_value(
                    states[f"{name}/exp_avg_sq"].long(),
                    states[f"{name}/exp_avg_sq_scale"].double(),
                    False,
                )
                grad = grads[name]
                gap = adam_update_gap(
                    engine_grads[name], grad, m, v, step=step, lr=lr, betas=(beta1, beta2), eps=eps
                )
                m = beta1 * m + (1 - beta1) * grad
                v = beta2 * v + (1 - beta2) * grad.square()
                decay = policy.weight_decay if name in reference.decay else 0.0
                w = weights[name] * (1 - lr * decay)
                denom = (v / (1 - beta2**step)).sqrt() + eps
                w = w - lr / (1 - beta1**step) * m / denom
                excess = (after[name].double() - w).abs() - gap
                assert (excess <= 2e-6 + 1e-5 * w.abs()).all(), (name, step, excess.max())
                moved = max(moved, float((w - weights[name]).abs().max()))
                # what the engine's float32 gradient moves each moment by, before rounding
                shift = {
                    "exp_avg": (1 - beta1) * (engine_grads[name].double() - grad).abs(),
                    "exp_avg_sq": (1 - beta2) * (engine_grads[name].double() ** 2 - grad**2).abs(),
                }
                for field, moment, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
                    top, floor = SIGNED if signed else UNSIGNED
                    codes, scales = _reference_codes(moment, signed)
                    got, got_scales = new[f"{name}/{field}"], new[f"{name}/{field}_scale"]
                    off = (got.long() - codes).abs()
                    # under the floor (codes 0 and 1) the gradients' rounding noise decides
                    floor_noise = (got.long().abs() <= 1) & (codes.abs() <= 1)
                    assert off.max() <= 1, (name, field)
                    assert (off[~floor_noise] > 0).float().mean() <= 1e-2, (name, field)
                    torch.testing.assert_close(got_scales.double(), scales, rtol=1e-4, atol=1e-12)
                    kept = _reference_value(got.long(), got_scales.double(), signed)
                    rounding = blockwise8.relative_error(top, floor) * (moment.abs() + shift[field])
                    under = (floor / 2 if signed else floor) * _block_absmax(kept)
                    bound = (shift[field] + rounding + under) * (1 + 1e-4) + 1e-30
                    assert ((kept - moment).abs() <= bound).all(), (name, field, step)
        assert moved > 5e-3  # the updates moved the weights


# -- whole runs: the loss curve, resume, refusals ----------------------------------------


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "gpt2_tiny", "--steps", str(steps), "--batch", "2",
        "--ga-rounds", "2", "--seq-len", "16", "--device", "cpu", "--lr", "3e-3",
        "--schedule", "constant", "--checkpoint-every", "2", "--out", str(out), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_fifty_steps_follow_the_fp32_moments_losses(tmp_path) -> None:
    """gpt2_tiny on the embedded corpus, 50 steps at lr 3e-3, int8 against fp32 moments
    from the same weights and batches: the first 20 losses within 0.01 of fp32's (seen:
    0.007), each 10-step window's mean within 0.05 (seen: 0.01), and both curves' 10-step
    means fall by more than 1 (4.7 to 3.4)."""
    curves = {}
    for states in ("fp32", "int8"):
        out = tmp_path / states
        result = invoke(*_args(out, 50, "--optimizer-states", states, "--checkpoint-every", "50"))
        assert result.exit_code == 0, result.output
        curves[states] = _losses(out)
    exact, int8 = curves["fp32"], curves["int8"]
    assert len(exact) == len(int8) == 50
    assert max(abs(a - b) for a, b in zip(exact[:20], int8[:20], strict=True)) <= 0.01
    for start in range(0, 50, 10):
        window = slice(start, start + 10)
        assert abs(sum(exact[window]) - sum(int8[window])) / 10 <= 0.05, start
    for curve in (exact, int8):
        assert sum(curve[:10]) / 10 - sum(curve[-10:]) / 10 > 1.0


def test_a_resumed_int8_run_repeats_the_straight_run_and_keeps_its_states(tmp_path) -> None:
    """Two steps, a checkpoint, two more on resume: the losses of four straight steps bit
    for bit (the codes and scales are the whole state). The checkpoint holds int8 and
    uint8 codes with their scales; a resume asking for other states is one line naming
    the differing field and what to do."""
    from dataflow_training.drive.checkpoint import read_checkpoint

    out, straight = tmp_path / "run", tmp_path / "straight"
    first = invoke(*_args(out, 2, "--optimizer-states", "int8"))
    assert first.exit_code == 0, first.output
    assert "int8 AdamW moments; 10.03 B/param)" in first.output
    _, opt, manifest, _ = read_checkpoint(out / "step_000002")
    assert manifest["train"]["optimizer"]["name"] == "adamw_int8"
    assert manifest["train"]["optimizer"]["state_dtypes"] == INT8_STATES
    refused = invoke(*_args(out, 4, "--resume", "auto", "--optimizer-states", "bf16"))
    assert_one_line_error(
        refused, 1, "train.optimizer.name is 'adamw_int8'", "resumes only as it was kept"
    )
    resumed = invoke(*_args(out, 4, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "optimizer_states int8" in resumed.output.splitlines()[0]
    assert invoke(*_args(straight, 4, "--optimizer-states", "int8")).exit_code == 0
    assert _losses(out) == _losses(straight)
    assert len(_losses(out)) == 4


def test_other_optimizers_refuse_int8_states(tmp_path) -> None:
    result = invoke(
        *_args(tmp_path / "run", 1, "--optimizer-states", "int8", "--optimizer", "lion")
    )
    assert_one_line_error(result, 2, "--optimizer-states int8", "--optimizer lion")
    conflict = invoke(
        *_args(tmp_path / "run", 1, "--optimizer-states", "int8", "--precision", "bf16")
    )
    assert_one_line_error(conflict, 2, "--optimizer-states int8 conflicts with --precision bf16")


# -- sizes: the program, the plan, predict ------------------------------------------------


def test_the_state_objects_are_priced_exactly() -> None:
    """gpt2_124m's optimizer state objects: each parameter's moments as int8 and uint8
    codes of its shape and two float32 scales of one per 256 elements, packed; together
    about a quarter of fp32 moments' bytes (2.03 of 8 bytes a parameter; the rest is
    alignment padding)."""
    from dataflow_training.step.family import load_family
    from dataflow_training.step.lowering import lower

    sizes, params = {}, 0
    for states in ("fp32", "int8"):
        train = TrainConfig(seq_len=64, optimizer=optimizer_states(states))
        step = lower(load_family("gpt2"), "gpt2_124m", train)
        objects = [o for o in step.program.objects if o.id.startswith("O_")]
        sizes[states] = sum(o.size_bytes for o in objects)
        for o in objects:
            assert o.size_bytes == step.layout.packed[o.id].layout.size_bytes
        if states == "int8":
            for o in objects:
                entries = {e.name: e for e in step.layout.packed[o.id].layout.entries}
                for name, entry in entries.items():
                    param, _, field = name.rpartition("/")
                    numel = math.prod(entries[f"{param}/exp_avg"].shape)
                    if field == "exp_avg":
                        params += numel
                    want = {
                        "exp_avg": "int8",
                        "exp_avg_sq": "uint8",
                        "exp_avg_scale": "float32",
                        "exp_avg_sq_scale": "float32",
                    }[field]
                    assert entry.dtype == want
                    if field.endswith("_scale"):
                        assert entry.shape == (blocks(numel),)
    assert sizes["fp32"] >= 8 * params
    assert 2 * params + 8 * params / BLOCK <= sizes["int8"] <= 1.01 * (2 + 8 / BLOCK) * params


def test_predict_shows_the_host_bytes_int8_states_free(tmp_path) -> None:
    """``dataflow predict --optimizer-states int8``: gpt2_124m at a 1 GiB budget offloads
    its optimizer state; with int8 moments the host (backing) peak and the bytes moved
    each step fall below bf16's, which fall below fp32's."""
    rows = {}
    for states in ("fp32", "bf16", "int8"):
        out = tmp_path / f"{states}.json"
        result = invoke(
            "predict", "--preset", "gpt2_124m", "--t-round", "4096", "--tokens-step", "8192",
            "--budget", "1", "--seq-len", "1024", "--jobs", "1", "--dtype", "bf16",
            "--optimizer-states", states, "--json", str(out),
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        (rows[states],) = json.loads(out.read_text())["rows"]
        assert rows[states]["feasible"] and rows[states]["optimizer_states"] == states
    backing = {s: r["backing_peak_bytes"] for s, r in rows.items()}
    moved = {s: r["h2d_gb"] + r["d2h_gb"] for s, r in rows.items()}
    assert backing["int8"] < backing["bf16"] < backing["fp32"]
    assert moved["int8"] < moved["bf16"] < moved["fp32"]
    assert rows["int8"]["precision"] == "bf16 weights, int8 moments"


def test_an_update_in_small_pieces_equals_one_in_a_single_piece(monkeypatch) -> None:
    """Tensors cut into pieces (a block-aligned cut inside a tensor, small tensors
    batched) update exactly as in one piece: blocks never straddle a cut."""
    from dataflow_kernels_torch.adamw_multi import adamw_multi
    from dataflow_training.optim import adamw_int8

    shapes = ((40, 64), (300,), (7,), (3, 5, 64))
    calls = {"pieces": 0}
    cut_up = adamw_int8._pieces

    def counted(*lists):
        for piece in cut_up(*lists):
            calls["pieces"] += 1
            yield piece

    monkeypatch.setattr(adamw_int8, "_pieces", counted)

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(7)
        params = [torch.randn(s, generator=gen) for s in shapes]
        states = {
            "exp_avg": [torch.zeros(s, dtype=torch.int8) for s in shapes],
            "exp_avg_sq": [torch.zeros(s, dtype=torch.uint8) for s in shapes],
            "exp_avg_scale": [torch.zeros(blocks(math.prod(s))) for s in shapes],
            "exp_avg_sq_scale": [torch.zeros(blocks(math.prod(s))) for s in shapes],
        }
        policy = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
        for step in (1, 2, 3):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            adamw_int8.adamw_int8_update(
                {"adamw_multi": adamw_multi}, params, grads, states, step=step,
                policy=policy, weight_decay=0.1,
            )  # fmt: skip
        return [*params, *(t for field in states.values() for t in field)]

    whole = run()
    monkeypatch.setattr(adamw_int8, "PIECE_ELEMENTS", 2 * BLOCK)
    calls["pieces"] = 0
    cut = run()
    assert calls["pieces"] == 3 * (5 + 1 + 1 + 2)  # 2560 and 960 elements cut at 512
    for a, b in zip(cut, whole, strict=True):
        assert torch.equal(a, b)
