"""TrainingRun's host memory for large models: start values made one object at a time
(``StartValues``), the weights' host copy handed over as the engine takes each object,
the slow pool's size known before it is allocated and refused past
``pinned_limit_bytes`` or (CUDA) the host's available memory, the reference state made
without a second whole copy, and a close that drops the state."""

from __future__ import annotations

import pytest
import torch
from dataflow_training.drive.values import StartValues, start_values
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost

pytest.importorskip("dataflow_family_gpt2")

TRAIN = TrainConfig(seq_len=8, batch=2, rounds=2)


def _run(**options):
    from dataflow_training.drive.run import TrainingRun

    return TrainingRun.of("gpt2", "gpt2_tiny", TRAIN, seed=0, **options)


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8), generator=g))
        for _ in range(2)
    ]


def test_start_values_are_made_on_lookup_and_equal_the_dict() -> None:
    run = _run()
    batches = _batches()
    calls = []

    def data(step, round_):
        calls.append(round_)
        return batches[round_]

    state = dict(run._weights)
    lazy = StartValues(run.compiled.running, state, data)
    assert calls == []  # nothing is made until it is looked up
    eager = start_values(run.compiled.running, state, lambda _s, r: batches[r])
    assert list(lazy) == list(eager) and len(lazy) == len(eager)
    for obj_id, value in eager.items():
        torch.testing.assert_close(lazy[obj_id], value, rtol=0, atol=0)
    assert "no such object" not in lazy
    with pytest.raises(KeyError):
        lazy["no such object"]
    consumed = StartValues(run.compiled.running, state, data, consume=True)
    for obj_id in consumed:
        consumed[obj_id]
    assert state == {}  # every parameter went into its packed object


def test_the_slow_pool_is_known_before_load_and_is_what_the_engine_allocates() -> None:
    run = _run()
    expected = run.compiled.pinned_bytes
    assert expected > 0  # this lowering starts W and O in slow memory
    run.step(_batches())
    assert run._engine._backend.slow.total_bytes == expected


def test_a_pool_past_the_pinned_limit_is_refused_before_anything_is_allocated() -> None:
    from dataflow import PlanningError

    run = _run(pinned_limit_bytes=1024)
    with pytest.raises(PlanningError, match=r"pinned_limit_bytes: more than the 1 KiB allowed"):
        run.step(_batches())
    weights, _ = run.state()  # refused before the weights were handed over
    assert weights and run._engine is None


def test_a_pool_past_the_hosts_memory_is_refused_on_cuda(monkeypatch) -> None:
    from dataflow_training.drive import run as run_module

    from dataflow import PlanningError

    run = _run()
    pool = run.compiled.pinned_bytes
    reserve = run_module.HOST_RESERVE_BYTES
    monkeypatch.setattr(run_module, "available_host_bytes", lambda: reserve + pool - 1)
    run.check_backing()  # off CUDA the pool is ordinary memory: only the limits given bind
    run.device = "cuda"  # (the check reads only the device's kind)
    with pytest.raises(PlanningError, match=r"host memory: more than the .* available less 8 GiB"):
        run.check_backing()
    monkeypatch.setattr(run_module, "available_host_bytes", lambda: reserve + pool)
    run.check_backing()  # exactly enough
    monkeypatch.setattr(run_module, "available_host_bytes", lambda: None)
    run.check_backing()  # a host that does not say: nothing to check against


def test_the_default_state_is_the_reference_models_in_the_param_dtype() -> None:
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.step.config import DtypePolicy
    from dataflow_training.step.family import load_family

    train = TrainConfig(seq_len=8, batch=2, rounds=2, dtype=DtypePolicy.named("bf16"))
    run = TrainingRun.of("gpt2", "gpt2_tiny", train, seed=3)
    family = load_family("gpt2")
    torch.manual_seed(3)
    expected = family.reference_model(family.config("gpt2_tiny")).state_dict()
    assert list(run._weights) == list(expected)
    for key, value in expected.items():
        got = run._weights[key]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, value.to(torch.bfloat16), rtol=0, atol=0)


def test_close_without_the_state_drops_it() -> None:
    run = _run()
    run.step(_batches())
    run.close(keep_state=False)
    with pytest.raises(RuntimeError, match="the run has no state: the run was closed"):
        run.state()


def test_a_pool_past_the_limit_is_planned_again_inside_a_slow_budget_that_fits() -> None:
    """Without ``backing_bytes`` the plan's slow memory is unbounded; where its pool would
    pass the limit (on CUDA: the host's memory) the run plans again inside a slow budget,
    trading offloads for recompute, and trains the same: what fits runs, and only what
    cannot fit is refused."""
    from dataflow_training.drive.run import TrainingRun

    from dataflow import PlanningError

    train = TrainConfig(seq_len=128, batch=8, rounds=2)
    budget = 5 * 2**20
    # declared costs: the plans (which a slow budget of limit // 2 cannot hold) do not
    # follow timings
    declared = {"budget_bytes": budget, "seed": 0, "cost": RooflineCost()}
    free = TrainingRun.of("gpt2", "gpt2_tiny", train, **declared)
    limit = free.compiled.pinned_bytes * 8 // 10
    fitted = TrainingRun.of("gpt2", "gpt2_tiny", train, **declared, pinned_limit_bytes=limit)
    assert free.compiled.pool_note is None
    assert fitted.compiled.pinned_bytes <= limit < free.compiled.pinned_bytes
    assert (
        fitted.compiled.backing_bytes is not None
        and fitted.compiled.predicted()["slow_peak_bytes"] <= limit
    )
    assert "planned inside a slow budget" in fitted.compiled.pool_note
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))
        for _ in range(2)
    ]
    for _ in range(2):
        a, b = free.step(batches), fitted.step(batches)
        assert abs(a.loss - b.loss) <= 1e-6 * abs(a.loss)
    # a limit no plan fits (at limit // 2 a plan with more blocks recomputed places)
    too_small = TrainingRun.of("gpt2", "gpt2_tiny", train, **declared, pinned_limit_bytes=4096)
    assert too_small.compiled.pool_note is None  # no plan inside it: the first plan, refused
    with pytest.raises(PlanningError, match="pinned_limit_bytes: more than"):
        too_small.step(batches)


def test_the_pool_limit_on_cuda_leaves_room_for_the_weights_still_to_be_made(monkeypatch) -> None:
    """``compile_step`` plans before the run makes the starting weights' host copy, which
    will be in host memory beside the pool: the limit it plans to leaves room for them."""
    from dataflow_training.plan import compiled_step as compiled_module

    run = _run()
    monkeypatch.setattr(compiled_module, "available_host_bytes", lambda: 64 * 2**30)
    assert compiled_module.pool_limits("cpu", None) == []  # off CUDA no limit was given
    reserve = compiled_module.HOST_RESERVE_BYTES
    # (the limit reads only the device's kind)
    assert compiled_module.pool_limits("cuda", None)[0][0] == 64 * 2**30 - reserve
    weights = sum(value.numel() * value.element_size() for value in run._weights.values())
    packed = sum(p.layout.size_bytes for p in run.compiled.layout.of_kind("W"))
    ((limit, _what),) = compiled_module.pool_limits("cuda", None, packed)
    room = 64 * 2**30 - reserve - limit
    assert weights <= room < weights * 11 // 10  # their packed objects' bytes, padding and all
