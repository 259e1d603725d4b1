"""A layer's routed experts in several shards (``kit.moe.expert_shards``): each shard a
parameter group of its own with its own forward, backward and optimizer tasks, the model
state, checkpoints and HF files holding the whole stacked tensors."""

from __future__ import annotations

import pytest
import torch
from dataflow_training import TrainingRun
from dataflow_training.check.verify import TOLERANCES, step_checks
from dataflow_training.drive.values import read_state, start_values
from dataflow_training.kit.moe import EXPERT_SHARD_BYTES, expert_shards
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

from dataflow import validate

# the tests lower and run the MoE families (not installed beside the training plugin alone)
for _package in (
    "dataflow_family_olmoe",
    "dataflow_family_qwen3_moe",
    "dataflow_family_deepseek",
    "dataflow_family_qwen3_5_moe",
):
    pytest.importorskip(_package, reason="the expert-shard tests run the MoE families")

TINY = [
    ("olmoe", "olmoe_tiny"),
    ("qwen3_moe", "qwen3_moe_tiny"),
    ("deepseek_v3", "deepseek_v3_tiny"),
    ("qwen3_5_moe", "qwen3_5_moe_tiny"),
]


@pytest.mark.parametrize(
    ("family", "preset", "shards"),
    [
        ("olmoe", "olmoe_1b_7b", 1),
        ("qwen3_moe", "qwen3_30b_a3b", 1),
        ("qwen3_5_moe", "qwen3_5_35b_a3b", 1),
        ("deepseek_v3", "deepseek_v3", 16),
        ("deepseek_v3", "kimi_k2", 16),
    ],
)
def test_the_shard_count_follows_the_experts_sizes(family, preset, shards) -> None:
    config = load_family(family).config(preset)
    width = getattr(config, "moe_intermediate_size", config.intermediate_size)
    assert expert_shards(config, width) == shards
    per_shard = config.num_experts // shards * 6 * config.hidden_size * width
    assert per_shard <= EXPERT_SHARD_BYTES
    if shards > 1:  # the next fewer shards that divide the experts would be too large
        fewer = max(s for s in range(1, shards) if config.num_experts % s == 0)
        assert config.num_experts // fewer * 6 * config.hidden_size * width > EXPERT_SHARD_BYTES


def test_a_shard_count_that_does_not_divide_the_experts_is_refused() -> None:
    family = load_family("olmoe")
    with pytest.raises(ValueError, match="expert_shards \\(3\\) must divide"):
        lower(family, "olmoe_tiny", TrainConfig(seq_len=8), overrides={"expert_shards": 3})


def test_each_task_holds_one_shard_of_the_experts() -> None:
    family = load_family("olmoe")
    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    step = lower(family, "olmoe_tiny", train, overrides={"expert_shards": 4})
    program = step.program
    assert validate(program) == []
    shards = [o.id for o in program.objects if o.id.startswith("W_0.experts.")]
    assert shards == [f"W_0.experts.{j}" for j in range(4)]
    for task in program.tasks:
        touched = {*task.inputs, *task.mutates, *task.outputs}
        assert len({o for o in touched if ".experts." in o and o.startswith("W_")}) <= 1, task.id
    kinds = [
        t.kind for t in program.tasks if t.params.get("layer") == "0" and t.params["round"] == 0
    ]
    assert kinds == ["fwd", *["efwd"] * 4, *["ebwd"] * 4, "bwd"]
    opt = [t.id for t in program.tasks if t.kind == "opt" and t.params["layer"] == "0"]
    assert sorted(opt) == ["opt_0_1_0", *(f"opt_0_1_0.experts.{j}" for j in range(4))]
    # re-derived: the routing forward again before the shards' backward, nothing saved:
    # forward's experts' object is their input alone, which the shards read and drop; the
    # rec task makes A and the input again, each shard's backward its gate_up rows
    rederived = lower(family, "olmoe_tiny", train, overrides={"expert_shards": 4}, recompute=[0])
    kinds = [
        t.kind
        for t in rederived.program.tasks
        if t.params.get("layer") == "0" and t.params["round"] == 0
    ]
    assert kinds == ["fwd", *["efwd"] * 4, "rec", *["ebwd"] * 4, "bwd"]
    tasks, packed = rederived.program.tasks_by_id, rederived.layout.packed
    assert tasks["rec_0_0_0"].compute_key == "olmoe.moe.route_recompute"
    assert tasks["fwd_0_0_0"].outputs == ("y_0_0_1", "A_0_0_0.moe_in", "AuxTemp_0_0_0")
    assert "A_0_0_0.moe_in" in tasks["efwd_0_0_0.experts.0"].inputs
    assert tasks["rec_0_0_0"].outputs == ("A_0_0_0", "A_0_0_0.experts")
    assert "A_0_0_0.experts" in tasks["ebwd_0_0_0.experts.3"].inputs
    for obj in ("A_0_0_0.moe_in", "A_0_0_0.experts"):
        assert [e.name for e in packed[obj].layout.entries] == ["moe_in"]
    assert [e.name for e in packed["A_0_0_1.experts"].layout.entries] == ["moe_in", "gate_up"]
    saving = step.program.tasks_by_id
    assert tasks["ebwd_0_0_0.experts.0"].cost_us > saving["ebwd_0_0_0.experts.0"].cost_us
    with pytest.raises(ValueError, match="re-derived whole or not at all"):
        lower(family, "olmoe_tiny", train, overrides={"expert_shards": 4}, partial={0: "mlp"})


def _shape(program):
    """Each task in order: (id, inputs, mutates, outputs)."""
    return [(t.id, t.inputs, t.mutates, t.outputs) for t in program.tasks]


def test_the_recompute_rewriter_splices_a_sharded_block_as_lowering_makes_it() -> None:
    """The recompute planner's candidates of a step with its experts apart are exactly
    what the lowering makes of their units, from the saving step and from one that
    re-derives some already: the same tasks in the same order reading and writing the same
    objects, of the same sizes; a shard's backward costs more re-derived."""
    from dataflow_training.plan.recompute import Rewriter

    family = load_family("qwen3_5_moe")
    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    shards = {"expert_shards": 2}
    saving = lower(family, "qwen3_5_moe_tiny", train, overrides=shards)
    units = [(0, 1), (1, 0), (1, 1)]
    wanted = lower(family, "qwen3_5_moe_tiny", train, overrides=shards, recompute=units)
    made = Rewriter(saving).candidate(units)
    assert _shape(made.program) == _shape(wanted.program)
    sizes = {o.id: o.size_bytes for o in wanted.program.objects}
    assert {o.id: o.size_bytes for o in made.program.objects} == sizes
    assert made.layout.packed.keys() == wanted.layout.packed.keys()
    # from a step that re-derives some already, one more unit
    more = lower(family, "qwen3_5_moe_tiny", train, overrides=shards, recompute=[*units, (0, 0)])
    assert _shape(Rewriter(wanted).candidate([(0, 0)]).program) == _shape(more.program)
    ebwd = "ebwd_0_1_1.experts.0"
    costs = {p.tasks_by_id[ebwd].cost_us for p in (made.program, saving.program)}
    assert made.program.tasks_by_id[ebwd].cost_us == max(costs) > min(costs)


def test_one_shard_lowers_the_program_as_before() -> None:
    family = load_family("olmoe")
    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    auto = lower(family, "olmoe_tiny", train).program
    one = lower(family, "olmoe_tiny", train, overrides={"expert_shards": 1}).program
    assert [t.id for t in auto.tasks] == [t.id for t in one.tasks]
    assert "W_0.experts" in {o.id for o in auto.objects}
    assert not any(t.kind in ("efwd", "ebwd") for t in auto.tasks)


@pytest.mark.parametrize(("family", "preset"), TINY)
@pytest.mark.parametrize("shards", [2, 4])
def test_a_sharded_step_matches_the_reference(family, preset, shards) -> None:
    """Two steps of two rounds with the experts in ``shards`` shards against the float64
    reference (unsplit): every loss, gradient and weight within the fp32 step tolerance."""
    checks = step_checks(
        load_family(family),
        preset,
        device="cpu",
        policy="fp32",
        budget_bytes=None,
        seed=3,
        tolerance=TOLERANCES["fp32"]["step"],
        overrides={"expert_shards": shards},
        batch=2,
        seq_len=8,
        steps=2,
        rounds=2,
    )
    assert any(c.name.startswith("grad ") and "mlp.experts.gate_up_proj" in c.name for c in checks)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def _batches(vocab: int, steps: int, rounds: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    return [
        [
            tuple(torch.randint(0, vocab, (2, 8), generator=g) for _ in range(2))
            for _ in range(rounds)
        ]
        for _ in range(steps)
    ]


def _run(
    family: str, preset: str, shards: int, freeze=(), device="cpu", dtype=None, **options
) -> TrainingRun:
    train = TrainConfig(seq_len=8, batch=2, rounds=2, dtype=dtype or DtypePolicy(), freeze=freeze)
    return TrainingRun.of(
        family, preset, train, overrides={"expert_shards": shards}, budget_bytes=None,
        device=device, seed=1, **options,
    )  # fmt: skip


@pytest.mark.parametrize(("family", "preset"), TINY[:3])
def test_shards_train_as_one_object_does(family, preset) -> None:
    """The engine's losses and gradients of a step from the same weights: S = 2 and 4
    against S = 1, to float32 rounding (the shards sum the routed rows in another order;
    a later step starts from weights that AdamW moved apart by rounding, and a near tie
    of the router may then choose otherwise)."""
    runs = {s: _run(family, preset, s, keep_grads=True) for s in (1, 2, 4)}
    batches = _batches(runs[1].vocab_size, 1, 2)
    losses = {s: [run.step(b).losses for b in batches] for s, run in runs.items()}
    grads = {s: run.grads() for s, run in runs.items()}
    for s in (2, 4):
        assert torch.tensor(losses[s]) == pytest.approx(torch.tensor(losses[1]), rel=1e-5)
        assert grads[s].keys() == grads[1].keys()
        for key, value in grads[1].items():
            scale = value.abs().max().item()
            torch.testing.assert_close(grads[s][key], value, rtol=1e-4, atol=1e-5 * scale, msg=key)


def test_a_frozen_sharded_bottom_block_keeps_only_the_experts_input() -> None:
    """A frozen bottom block whose experts run apart has no backward: its experts' object
    holds their input alone (the shards write no ``gate_up``), and the step trains as
    the unsharded one does, to float32 rounding."""
    freeze = ("embed", "layers.0")
    runs = {s: _run("olmoe", "olmoe_tiny", s, freeze=freeze) for s in (1, 2)}
    packed = runs[2].compiled.lowered.layout.packed
    assert [e.name for e in packed["A_0_0_0.experts"].layout.entries] == ["moe_in"]
    assert [e.name for e in packed["A_0_0_1.experts"].layout.entries] == ["moe_in", "gate_up"]
    for batches in _batches(runs[1].vocab_size, 2, 2):
        got, want = (runs[s].step(batches).losses for s in (2, 1))
        assert torch.tensor(got) == pytest.approx(torch.tensor(want), rel=1e-5)


@pytest.mark.parametrize(("family", "preset"), [TINY[0], TINY[2], TINY[3]])
def test_a_sharded_block_re_derived_trains_bitwise_as_the_saving_one(
    family, preset, forced_planner
) -> None:
    """A block whose experts run apart, re-derived (its routing task's saves and the
    experts' input made again before the shards' backward, each shard's ``gate_up`` rows
    made again there): the same bits as saving it."""
    units = frozenset({(0, 0), (1, 1), (1, 0)})
    saving = _run(family, preset, 2, recompute=False)
    forced = _run(family, preset, 2, planner=forced_planner(units))
    rec = [t for t in forced.compiled.program.tasks if t.kind == "rec"]
    routed = [t for t in rec if t.compute_key.endswith(".route_recompute")]
    assert len(rec) == 3 and routed  # (DeepSeek's first block is dense: a plain rec)
    for batches in _batches(saving.vocab_size, 2, 2):
        assert saving.step(batches).losses == forced.step(batches).losses
    theirs = forced.state()[0]
    for name, tensor in saving.state()[0].items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "preset"), [TINY[0], TINY[3]])
def test_a_sharded_block_re_derived_on_cuda_trains_as_the_saving_one(
    family, preset, forced_planner
) -> None:
    """On CUDA (the shards add their rows with atomics: not bit-reproducible), a sharded
    block re-derived against saving it: the same losses and weights to float32
    rounding over two steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    units = frozenset({(0, 0), (1, 1), (1, 0)})
    saving = _run(family, preset, 2, device="cuda", recompute=False)
    forced = _run(family, preset, 2, device="cuda", planner=forced_planner(units))
    assert sum(t.kind == "rec" for t in forced.compiled.program.tasks) == 3
    for batches in _batches(saving.vocab_size, 2, 2):
        got, want = forced.step(batches).losses, saving.step(batches).losses
        assert torch.tensor(got) == pytest.approx(torch.tensor(want), rel=1e-5)
    theirs = forced.state()[0]
    for name, tensor in saving.state()[0].items():
        torch.testing.assert_close(theirs[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "preset"), [TINY[0], TINY[2], TINY[3]])
def test_a_sharded_step_on_cuda_replays_from_a_graph_as_the_whole_one_trains(
    family, preset
) -> None:
    """On CUDA in bf16 (the grouped GEMMs' kernel: the float32 loop reads the offsets on
    the host) a step whose experts run in shards is replayed from a CUDA graph (each
    shard's rows a window of every row, nothing read on the host: ``ShardWindow``), and
    trains as the unsharded step does over three steps, the routing new each step: the
    same losses to bf16 rounding (rel 2e-2: the shards add their rows in float32 with
    atomics, the whole block gathers them, each rounded to bf16 once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    bf16 = DtypePolicy("bfloat16", "bfloat16", "bfloat16")
    runs = {s: _run(family, preset, s, device="cuda", dtype=bf16) for s in (1, 2)}
    for batches in _batches(runs[1].vocab_size, 3, 2):
        got, want = (runs[s].step(batches).losses for s in (2, 1))
        assert torch.tensor(got) == pytest.approx(torch.tensor(want), rel=2e-2)
    assert runs[1].graph_note is None, runs[1].graph_note
    assert runs[2].graph_note is None, runs[2].graph_note


def test_the_state_goes_in_and_comes_out_whole() -> None:
    """The model state's stacked experts cut into the shards' objects and joined again,
    bit for bit."""
    family = load_family("olmoe")
    step = lower(family, "olmoe_tiny", TrainConfig(seq_len=8), overrides={"expert_shards": 4})
    torch.manual_seed(0)
    state = family.reference_model(step.config).state_dict()
    values = start_values(step, state, lambda s, r: (torch.zeros(1, 8), torch.zeros(1, 8)))
    back = read_state(step, values.__getitem__)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_a_sharded_run_resumes_from_its_checkpoint(tmp_path) -> None:
    """Two steps straight against one step, a checkpoint, a new run restored from it and
    one more step: the same losses and weights, bit for bit."""
    straight = _run("olmoe", "olmoe_tiny", 2)
    batches = _batches(straight.vocab_size, 2, 2)
    expected = [straight.step(b).losses for b in batches]
    first = _run("olmoe", "olmoe_tiny", 2)
    assert first.step(batches[0]).losses == expected[0]
    first.save(tmp_path / "ckpt")
    first.close()
    resumed = _run("olmoe", "olmoe_tiny", 2)
    resumed.restore(tmp_path / "ckpt")
    assert resumed.step(batches[1]).losses == expected[1]
    (weights, opt), (want, want_opt) = resumed.state(), straight.state()
    for key, value in want.items():
        assert torch.equal(weights[key], value), key
    for key, value in want_opt.items():
        assert torch.equal(opt[key], value), key


@pytest.mark.parametrize("after", [4, 1])
def test_a_resume_in_other_shards_cuts_the_optimizer_state_again(after, tmp_path) -> None:
    """A checkpoint of two shards resumed in ``after``: the optimizer state joined along
    the experts and cut again (``values.recut_opt``), so the next step is the straight
    run's to float32 rounding (shards sum the routed rows in another order), and the
    state comes back in ``after``'s objects."""
    straight = _run("olmoe", "olmoe_tiny", 2)
    batches = _batches(straight.vocab_size, 2, 2)
    expected = [straight.step(b).losses for b in batches]
    first = _run("olmoe", "olmoe_tiny", 2)
    first.step(batches[0])
    first.save(tmp_path / "ckpt")
    first.close()
    resumed = _run("olmoe", "olmoe_tiny", after)
    resumed.restore(tmp_path / "ckpt")
    got = resumed.step(batches[1]).losses
    assert torch.tensor(got) == pytest.approx(torch.tensor(expected[1]), rel=1e-5)
    opt = resumed.state()[1]
    shards = {k for k in opt if k.startswith("O_0.experts")}
    assert shards == ({"O_0.experts"} if after == 1 else {f"O_0.experts.{j}" for j in range(after)})


@pytest.mark.parametrize(("family", "preset"), TINY[:3])
def test_a_sharded_run_exports_and_imports_hf_bit_for_bit(family, preset, tmp_path) -> None:
    """The weights a run with its experts in two shards ends with, written as an HF
    checkpoint and read back: the same tensors, bit for bit, under the same keys."""
    run = _run(family, preset, 2)
    run.step(_batches(run.vocab_size, 1, 2)[0])
    state = run.state()[0]
    loaded = load_family(family)
    loaded.export_hf(run.compiled.lowered.config, state, tmp_path / "hf")
    _config, back = loaded.import_hf(tmp_path / "hf")
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_the_forward_only_step_runs_sharded_experts_shard_by_shard() -> None:
    """The evaluation's step of a sharded model: a routing ``fwd`` and one ``efwd`` a
    shard per block, each ``efwd`` reading its shard's weights alone (its loss against the
    training step's: test_evaluation.py)."""
    from dataflow_training.step.forward_only import lower_forward

    family = load_family("olmoe")
    train = TrainConfig(seq_len=8, batch=2, rounds=1)
    whole = lower_forward(family, "olmoe_tiny", train).program
    assert "efwd" not in {task.kind for task in whole.tasks}
    sharded = lower_forward(family, "olmoe_tiny", train, overrides={"expert_shards": 2}).program
    efwd = [task for task in sharded.tasks if task.kind == "efwd"]
    blocks = sum(1 for task in sharded.tasks if task.kind == "fwd")
    assert len(efwd) == 2 * blocks
    for task in efwd:
        weights = [name for name in task.inputs if name.startswith("W_")]
        assert len(weights) == 1 and ".experts." in weights[0], task.inputs


@pytest.mark.parametrize(("family", "preset"), [TINY[0], TINY[2]])
def test_a_shards_math_reads_nothing_on_the_host(family, preset) -> None:
    """A shard's forward and backward run on tensors without values (the meta device),
    the grouped GEMMs stood in by their shapes: nothing the math does reads a routing
    decision on the host, so a CUDA graph can capture it and replay it with any routing
    (until session 41 each shard read its row span, ``.tolist()``, and a step with its
    experts apart ran dispatched: 22 % over its plan on the H100)."""
    from dataflow_training.kit.moe import DOWN, GATE_UP
    from dataflow_training.step.family import Env
    from dataflow_training.step.ops import load_ops

    plugin = load_family(family)
    config = plugin.config(preset)
    block = next(layer for layer in plugin.layers(config) if layer.params and "moe" in layer.kind)
    math = plugin.math(block.kind)
    shards, k, tokens = 2, config.num_experts_per_tok, 24
    per, n = config.num_experts // shards, config.hidden_size
    inner = math.ffn.inner(config)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    ops = dict(load_ops("cpu", plugin.ops))
    ops["grouped_mm"] = lambda x, w, offsets: x.new_empty(x.shape[0], w.shape[1])
    ops["grouped_mm_wgrad"] = lambda dy, x, offsets: dy.new_empty(
        offsets.numel() - 1, dy.shape[1], x.shape[1]
    )
    params = {
        GATE_UP: torch.empty(per, 2 * inner, n, **meta),
        DOWN: torch.empty(per, n, inner, **meta),
    }
    aux_temp = {
        "ids": torch.empty(tokens, k, device="meta", dtype=torch.int32),
        "weights": torch.empty(tokens, k, **meta),
        "order": torch.empty(tokens * k, device="meta", dtype=torch.int32),
        "offsets": torch.empty(config.num_experts + 1, device="meta", dtype=torch.int32),
    }
    experts = {
        "moe_in": torch.empty(tokens, n, **meta),
        "gate_up": torch.empty(tokens * k, 2 * inner, **meta),
    }
    env = Env(ops)
    out, gate_up, window = math.experts_forward(config, params, experts, aux_temp, (1, shards), env)
    assert out.shape == (tokens, n) and out.dtype == torch.float32
    assert gate_up.shape == (tokens * k, 2 * inner) and window.rows.shape == (tokens * k,)
    for saved in (experts, {"moe_in": experts["moe_in"]}):  # saved gate_up, or re-derived
        dy = torch.empty(tokens, n, **meta)
        d_in, d_weights, window, grads = math.experts_backward(
            config, params, saved, aux_temp, dy, (0, shards), env
        )
        assert d_in.shape == (tokens, n) and d_weights.shape == (tokens * k,)
        assert {name: g.shape for name, g in grads.items()} == {
            GATE_UP: (per, 2 * inner, n),
            DOWN: (per, n, inner),
        }
        window.put(ops, d_weights, torch.empty(tokens * k, device="meta", dtype=torch.float32))


def test_the_shard_window_puts_its_rows_and_keeps_the_others() -> None:
    """``ShardWindow``: every row once, the shard's first (wrapping round); its rows added
    into their tokens, the rest ignored; written back only where the shard's, whatever
    the window's other rows hold (NaN here)."""
    from types import SimpleNamespace

    from dataflow_training.kit.moe import RoutedExperts
    from dataflow_training.step.ops import load_ops

    ops = load_ops("cpu", ("rows_add_masked", "rows_put_masked", "rows_gather_masked"))

    offsets = torch.tensor([0, 3, 3, 7, 10], dtype=torch.int32)  # 4 experts, 10 rows
    aux_temp = {"offsets": offsets, "order": torch.zeros(10, dtype=torch.int32)}
    config = SimpleNamespace(num_experts=4)
    window, local = RoutedExperts()._shard_window(config, aux_temp, (1, 2))  # experts 2, 3
    assert window.rows.tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert window.valid.tolist() == [True] * 7 + [False] * 3
    assert local.tolist() == [0, 4, 7]  # expert 1 has none of the rows
    window, local = RoutedExperts()._shard_window(config, aux_temp, (0, 2))  # experts 0, 1
    assert window.rows.tolist()[:3] == [0, 1, 2] and window.valid.sum() == 3
    assert local.tolist() == [0, 3, 3]
    target = torch.arange(10.0)
    values = torch.full((10,), float("nan"))
    values[:3] = torch.tensor([-1.0, -2.0, -3.0])
    window.put(ops, values, target)
    assert target.tolist() == [-1.0, -2.0, -3.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    tokens = torch.tensor([1, 0, 1, 2, 2, 2, 2, 2, 2, 2])  # the window's rows' tokens
    out = window.add(ops, values[:, None], tokens, torch.tensor([2.0] * 10), 3, 2)
    assert out.dtype == torch.float32
    assert out.squeeze(1).tolist() == [-4.0, -8.0, 0.0]  # the NaN rows add nothing
    source = torch.arange(30.0).view(10, 3)
    gathered = window.gather(ops, source, window.rows)
    assert torch.equal(gathered[:3], source[:3])  # the shard's rows; the others anything


#: the window ops of a shard (``ShardWindow``) whose fast variants read the shard's rows
#: alone
WINDOW_OPS = ("rows_add_masked", "rows_put_masked", "rows_gather_masked", "swiglu_rows_bwd")


def _shard_math(ops, family, preset, shards, device, dtype, seed=0):
    """Each shard's forward and backward (its ``gate_up`` saved, and re-derived) over one
    random routing of 24 tokens, its results where they land (every expert row)."""
    from dataflow_training.kit.moe import DOWN, GATE_UP, dispatch
    from dataflow_training.step.family import Env

    plugin = load_family(family)
    config = plugin.config(preset)
    block = next(layer for layer in plugin.layers(config) if layer.params and "moe" in layer.kind)
    math = plugin.math(block.kind)
    g = torch.Generator().manual_seed(seed)
    k, tokens, experts = config.num_experts_per_tok, 24, config.num_experts
    n, inner, per = config.hidden_size, math.ffn.inner(config), experts // shards
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).int()
    order, offsets, _ = dispatch(config, ids)
    aux_temp = {
        "ids": ids,
        "weights": torch.rand(tokens, k, generator=g),
        "order": order,
        "offsets": offsets,
    }
    moe_in, dy = torch.randn(tokens, n, generator=g), torch.randn(tokens, n, generator=g)
    params = [
        {
            GATE_UP: torch.randn(per, 2 * inner, n, generator=g) * 0.1,
            DOWN: torch.randn(per, n, inner, generator=g) * 0.1,
        }
        for _ in range(shards)
    ]
    move = lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device)  # noqa: E731
    aux_temp = {name: move(t) for name, t in aux_temp.items()}
    moe_in, dy = move(moe_in), move(dy)
    env, results = Env(ops), []
    for shard in range(shards):
        w = {name: move(t) for name, t in params[shard].items()}
        out, gate_up, window = math.experts_forward(
            config, w, {"moe_in": moe_in}, aux_temp, (shard, shards), env
        )
        every = torch.zeros(tokens * k, 2 * inner, device=device, dtype=dtype)
        window.put(ops, gate_up, every)
        results += [out, every]
        for saved in ({"moe_in": moe_in, "gate_up": every}, {"moe_in": moe_in}):
            d_in, d_weights, window, grads = math.experts_backward(
                config, w, saved, aux_temp, dy, (shard, shards), env
            )
            placed = torch.zeros(tokens * k, device=device)
            window.put(ops, d_weights, placed)
            results += [d_in, placed, grads[GATE_UP], grads[DOWN]]
    return results


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "preset"), [TINY[0], TINY[3]])
def test_the_window_ops_fast_variants_run_the_shards_as_the_torch_ones(family, preset) -> None:
    """On CUDA in float32, each shard's math with the window ops' fast (Triton) variants,
    which read and write the shard's rows alone and leave the window's other rows as
    their buffers held them, against the torch variants (every row): the same outputs,
    gradients and written rows to float32 rounding, all finite."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow_training.step.ops import load_ops

    from dataflow import kernels

    plugin = load_family(family)
    fast = dict(load_ops("cuda", plugin.ops))
    names = {op: v.name for op in WINDOW_OPS for v in kernels().for_op(op, device="cuda")[:1]}
    if set(names.values()) == {"torch"}:
        pytest.skip("no fast variant of the window ops is registered here")
    torch_ops = dict(fast) | {op: kernels().get(f"{op}/torch").load() for op in WINDOW_OPS}
    got = _shard_math(fast, family, preset, 2, "cuda", torch.float32)
    want = _shard_math(torch_ops, family, preset, 2, "cuda", torch.float32)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(a).all(), i
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"result {i} ({names})")
