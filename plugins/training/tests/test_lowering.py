"""The lowering: names, order, exact sizes, rounds, tied gradients, recompute; and every
lowered step validates, simulates and plans into a budget."""

from __future__ import annotations

import math

import attrs
import pytest
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import lower
from dataflow_training.step.packing import ALIGN_BYTES
from dataflow_training.testing.toy import ToyFamily

from dataflow import Links, minimal_budget, plan, simulate, validate


def test_task_order_and_names_for_two_rounds() -> None:
    program = lower(ToyFamily(), "small", TrainConfig(seq_len=4, batch=2, rounds=2)).program
    ids = [task.id for task in program.tasks]
    one_round = lambda r: [  # noqa: E731
        f"embed_0_{r}_emb",
        f"fwd_0_{r}_0",
        f"fwd_0_{r}_1",
        f"fwd_0_{r}_2",
        f"head_0_{r}_head",
        f"bwd_0_{r}_2",
        f"bwd_0_{r}_1",
        f"bwd_0_{r}_0",
        f"embbwd_0_{r}_emb",
    ]
    assert ids == [
        *one_round(0),
        *one_round(1),
        "opt_0_1_head",
        "opt_0_1_2",
        "opt_0_1_1",
        "opt_0_1_0",
        "opt_0_1_emb",
    ]
    assert validate(program) == []


def test_round_zero_creates_gradients_later_rounds_accumulate() -> None:
    program = lower(ToyFamily(), "small", TrainConfig(seq_len=4, rounds=2)).program
    tasks = program.tasks_by_id
    assert "dW_1" in tasks["bwd_0_0_1"].outputs and "dW_1" in tasks["bwd_0_1_1"].mutates
    # tied: the head creates dW_emb in round 0, the embedding backward adds to it
    assert "dW_emb" in tasks["head_0_0_head"].outputs
    assert (
        "dW_emb" in tasks["embbwd_0_0_emb"].mutates and "dW_emb" in tasks["head_0_1_head"].mutates
    )
    assert "W_emb" in tasks["head_0_0_head"].inputs


def test_sizes_are_exact_and_aligned() -> None:
    train = TrainConfig(seq_len=5, batch=3, dtype=DtypePolicy.named("bf16"))
    program = lower(ToyFamily(), "small", train).program
    dim = ToyFamily().config("small").dim
    w = program.obj("W_1")
    # w (dim x dim bf16) and b (dim bf16), each starting at an aligned offset
    assert w.size_bytes == math.ceil(dim * dim * 2 / ALIGN_BYTES) * ALIGN_BYTES + ALIGN_BYTES
    assert program.obj("y_0_0_0").size_bytes == 3 * 5 * dim * 2
    assert program.obj("x_0_0").tensor.dtype == "int64"
    layout = StepLayout.of(program).packed["O_1"].layout
    # AdamW states stay float32 under the bf16 policy: each field over the group's tensors
    assert [e.name for e in layout.entries] == [
        "w/exp_avg",
        "b/exp_avg",
        "w/exp_avg_sq",
        "b/exp_avg_sq",
    ]
    assert {e.dtype for e in layout.entries} == {"float32"}
    assert (
        program.obj("A_0_0_2").size_bytes == math.ceil(3 * 5 * dim * 2 / ALIGN_BYTES) * ALIGN_BYTES
    )


def test_recompute_moves_saving_to_just_before_backward() -> None:
    program = lower(ToyFamily(), "small", TrainConfig(seq_len=4), recompute=[1]).program
    ids = [task.id for task in program.tasks]
    tasks = program.tasks_by_id
    assert tasks["fwd_0_0_1"].outputs == ("y_0_0_2",)
    assert ids.index("rec_0_0_1") == ids.index("bwd_0_0_1") - 1
    assert tasks["rec_0_0_1"].outputs == ("A_0_0_1",)
    assert validate(program) == []
    with pytest.raises(ValueError, match=r"recompute names block 7 of round 0"):
        lower(ToyFamily(), "small", TrainConfig(seq_len=4), recompute=[7])


def test_recompute_of_one_round_leaves_the_other_rounds_saving() -> None:
    train = TrainConfig(seq_len=4, rounds=2)
    program = lower(ToyFamily(), "small", train, recompute=[(1, 0)]).program
    tasks = program.tasks_by_id
    assert "rec_0_1_0" in tasks and "rec_0_0_0" not in tasks
    assert "A_0_0_0" in tasks["fwd_0_0_0"].outputs
    assert "A_0_1_0" not in tasks["fwd_0_1_0"].outputs
    assert validate(program) == []
    with pytest.raises(ValueError, match=r"recompute names block 0 of round 2"):
        lower(ToyFamily(), "small", train, recompute=[(2, 0)])


@pytest.mark.parametrize("rounds", [1, 3])
def test_lowered_steps_plan_into_tight_budgets(rounds: int) -> None:
    program = lower(ToyFamily(), "small", TrainConfig(seq_len=16, batch=2, rounds=rounds)).program
    generous = plan(program, 2**30)
    assert generous.sim.valid
    tight = minimal_budget(program)
    planned = plan(program, tight)
    assert planned.sim.valid and planned.sim.fast_peak_bytes <= tight
    assert simulate(planned.program).valid


def test_a_fleet_member_all_reduces_each_gradient_after_its_last_round() -> None:
    """``grad_share``: one ``allreduce`` per trainable group, right after the task that
    completes the group's last-round gradient and before its ``gnorm``, mutating the
    ``dW``, with the share in its params; the step still validates and plans."""
    train = TrainConfig(seq_len=4, batch=2, rounds=2, clip=1.0)
    plain = lower(ToyFamily(), "small", train).program
    program = lower(ToyFamily(), "small", train, grad_share=0.25).program
    tasks = list(program.tasks)
    reduces = [t for t in tasks if t.id.startswith("allreduce_")]
    dws = {o.id for o in program.objects if o.id.startswith("dW_")}
    assert sorted(o for t in reduces for o in t.mutates) == sorted(dws)
    assert len(tasks) == len(plain.tasks) + len(dws)
    for t in reduces:
        (dw,) = t.mutates
        at = tasks.index(t)
        writers = [i for i, u in enumerate(tasks) if u is not t and dw in (*u.outputs, *u.mutates)]
        before = [i for i in writers if i < at]
        assert before and tasks[max(before)].params["round"] == 1  # after the last round
        assert all(tasks[i].kind == "opt" for i in writers if i > at)  # only the update after
        gnorm = next(i for i, u in enumerate(tasks) if u.kind == "gnorm" and dw in u.inputs)
        assert at < gnorm
        assert t.params["share"] == 0.25
        assert t.collective and t.cost_us == 0.0  # on the collective link, priced by it
    assert program.links.collective is not None
    assert not validate(program)
    plan(program, minimal_budget(program))


def test_a_fleet_members_all_reduce_overlaps_the_backward_below() -> None:
    """Simulated, the all-reduce of a block's gradient runs while compute runs the
    backward of the block below it: its span overlaps that task's, and the link's time
    under compute (hidden) is most of its busy time with a link as fast as compute."""
    from dataflow import Link

    train = TrainConfig(seq_len=4, batch=2, rounds=1)
    links = Links(collective=Link(bw_bytes_per_us=1000.0, latency_us=1.0))
    program = lower(ToyFamily(), "small", train, grad_share=0.5, links=links).program
    result = plan(program, 2**30).sim
    spans = {t.task_id: (t.start_us, t.end_us) for t in result.tasks}
    order = [t.id for t in program.tasks]
    reduce_ = next(i for i in order if i.startswith("allreduce_"))
    below = next(i for i in order[order.index(reduce_) :] if i.startswith(("bwd_", "embbwd_")))
    assert spans[below][0] < spans[reduce_][1] and spans[reduce_][0] < spans[below][1]
    assert result.collective.transfers == sum(t.collective for t in program.tasks)
    assert result.collective_exposed_us < result.collective.busy_us


def test_layer_order_runs_every_round_through_a_layer_before_the_next() -> None:
    """The same tasks, reordered: forwards by layer then round, backwards (a recompute
    right before its backward) by layer descending then round, each group's update right
    after the last task that touches its weights or gradient (early updates, layer
    orders' default; the tied embedding's after the embedding backward)."""
    train = TrainConfig(seq_len=4, batch=2, rounds=2, order="layer")
    by_round = lower(ToyFamily(), "small", attrs.evolve(train, order="round"), recompute=[1])
    by_layer = lower(ToyFamily(), "small", train, recompute=[1])
    ids = [task.id for task in by_layer.program.tasks]
    assert sorted(ids) == sorted(task.id for task in by_round.program.tasks)
    assert ids == [
        *(f"embed_0_{r}_emb" for r in (0, 1)),
        *(f"fwd_0_{r}_{i}" for i in (0, 1, 2) for r in (0, 1)),
        *(f"head_0_{r}_head" for r in (0, 1)),
        "opt_0_1_head",
        "bwd_0_0_2",
        "bwd_0_1_2",
        "opt_0_1_2",
        "rec_0_0_1",
        "bwd_0_0_1",
        "rec_0_1_1",
        "bwd_0_1_1",
        "opt_0_1_1",
        "bwd_0_0_0",
        "bwd_0_1_0",
        "opt_0_1_0",
        *(f"embbwd_0_{r}_emb" for r in (0, 1)),
        "opt_0_1_emb",
    ]
    ends = [
        t.id for t in lower(ToyFamily(), "small", attrs.evolve(train, updates="end")).program.tasks
    ]
    assert ends[-5:] == ["opt_0_1_head", "opt_0_1_2", "opt_0_1_1", "opt_0_1_0", "opt_0_1_emb"]
    assert validate(by_layer.program) == []
    tight = minimal_budget(by_layer.program)
    assert plan(by_layer.program, tight).sim.valid


def test_layer_order_in_groups_runs_each_group_of_rounds_by_layer_in_turn() -> None:
    """``layer:K``: rounds 0..K-1 by layer, then the next K (the last group smaller);
    ``layer:1`` is round order's chain and ``layer:K`` with K >= rounds layer order's."""
    train = TrainConfig(seq_len=4, batch=2, rounds=3, order="layer:2")
    ids = [task.id for task in lower(ToyFamily(), "small", train).program.tasks]

    def group(rounds):
        return [
            *(f"embed_0_{r}_emb" for r in rounds),
            *(f"fwd_0_{r}_{i}" for i in (0, 1, 2) for r in rounds),
            *(f"head_0_{r}_head" for r in rounds),
            *(f"bwd_0_{r}_{i}" for i in (2, 1, 0) for r in rounds),
            *(f"embbwd_0_{r}_emb" for r in rounds),
        ]

    optimizer = ["opt_0_2_head", "opt_0_2_2", "opt_0_2_1", "opt_0_2_0", "opt_0_2_emb"]
    ends = lower(ToyFamily(), "small", attrs.evolve(train, updates="end")).program.tasks
    assert [t.id for t in ends] == [*group((0, 1)), *group((2,)), *optimizer]
    assert sorted(ids) == sorted(t.id for t in ends)

    def chain(order, updates="auto"):
        changed = attrs.evolve(train, order=order, updates=updates)
        return [t.id for t in lower(ToyFamily(), "small", changed).program.tasks]

    assert chain("layer:1", "end") == chain("round")
    assert chain("layer:3") == chain("layer:7") == chain("layer")
    assert attrs.evolve(train, order="layer:7").order_group == 3


def test_early_updates_follow_the_last_use_of_their_group() -> None:
    """``updates="early"`` in round order: each block's update right after the last
    round's backward of that block, the head's after the last head, the tied embedding's
    after the last embedding backward; with a clip (every update reads the global norm)
    ``auto`` keeps them at the end and ``early`` is refused, naming the field."""
    train = TrainConfig(seq_len=4, batch=2, rounds=2, updates="early")
    ids = [t.id for t in lower(ToyFamily(), "small", train).program.tasks]
    assert ids[-10:] == [
        "head_0_1_head",
        "opt_0_1_head",
        "bwd_0_1_2",
        "opt_0_1_2",
        "bwd_0_1_1",
        "opt_0_1_1",
        "bwd_0_1_0",
        "opt_0_1_0",
        "embbwd_0_1_emb",
        "opt_0_1_emb",
    ]
    program = lower(ToyFamily(), "small", train).program
    assert validate(program) == [] and plan(program, minimal_budget(program)).sim.valid
    clipped = TrainConfig(seq_len=4, batch=2, rounds=2, order="layer", clip=1.0)
    tasks = lower(ToyFamily(), "small", clipped).program.tasks
    assert [t.kind for t in tasks[-5:]] == ["opt"] * 5
    with pytest.raises(ValueError, match="updates='early' cannot clip"):
        attrs.evolve(clipped, updates="early")
    with pytest.raises(ValueError, match="updates must be one of auto, early, end"):
        TrainConfig(seq_len=4, updates="soon")


@pytest.mark.parametrize("bad", ["layers", "layer:0", "layer:", "round:2", "layer:x"])
def test_an_unknown_order_names_itself(bad) -> None:
    with pytest.raises(ValueError, match=rf"order '{bad}': one of round, layer or layer:K"):
        TrainConfig(seq_len=4, order=bad)


def test_layer_order_reads_weights_once_a_step_when_they_do_not_fit() -> None:
    """A wide toy whose weights are far larger than its activations, in a budget that
    holds one layer's: by rounds every round fetches every weight twice (forward and
    backward); by layers each weight crosses once each way, so less comes over the link."""
    train = TrainConfig(seq_len=4, batch=1, rounds=4)
    wide = {"dim": 128, "layers": 4}
    programs = {
        order: lower(ToyFamily(), "small", attrs.evolve(train, order=order), overrides=wide).program
        for order in ("round", "layer")
    }
    budget = max(minimal_budget(program) for program in programs.values())
    sims = {order: plan(program, budget).sim for order, program in programs.items()}
    assert all(sim.valid for sim in sims.values())
    assert sims["layer"].h2d.bytes < 0.6 * sims["round"].h2d.bytes
    assert sims["layer"].makespan_us < sims["round"].makespan_us
