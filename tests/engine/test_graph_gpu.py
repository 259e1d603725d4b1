"""Whole-step CUDA graph replay: bit for bit what dynamic dispatch computes.

The example chain is planned at its tightest budget (so the step prefetches and writes
back), placed, and run for several steps twice: dispatched, and with the engine capturing
the second step and replaying it from then on. Every step's results must be identical,
bit for bit, and the replayed steps must really be replays. A training run of GPT-2 tiny
at a tight budget does the same with real optimizer updates: the losses and final
weights of the two runs are identical.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine import Engine  # noqa: E402
from dataflow.planning import minimal_budget, place, plan  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 4


def _chain_steps(graph: bool, dispatch_at: tuple[int, ...] = ()):
    from dataflow.engine.backends.torch_cuda import runtime_reserve_bytes

    program = chain.build_program(6, 1024, 4096)
    values = chain.initial_values(program)
    objects_bytes = minimal_budget(program)
    planned = plan(program, objects_bytes)
    placement = place(planned)
    budget = objects_bytes + runtime_reserve_bytes("cuda")
    outputs, traces = [], []
    with Engine("torch", budget_bytes=budget, device="cuda", graph=graph) as engine:
        engine.load(placement, build(placement.plan.program), initial=values)
        for step in range(STEPS):
            dispatch = step in dispatch_at
            result = engine.run(steps=1, feed=lambda _step: values, dispatch=dispatch)
            traces.append(result.steps[0])
            outputs.append({k: engine.fetch(k) for k in program.final_locations})
        note = engine.graph_note
    return outputs, traces, note, result, budget


def test_replayed_chain_is_bit_identical_to_dispatch() -> None:
    dispatched, plain, _, _, _ = _chain_steps(graph=False)
    replayed, traces, note, result, budget = _chain_steps(graph=True)
    assert note is None, note
    assert [t.replayed for t in traces] == [False] + [True] * (STEPS - 1)
    assert sum(t.size_bytes for t in plain[0].transfers) > 0  # the plan moves data
    for step, (a, b) in enumerate(zip(dispatched, replayed, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs"
    assert 0 < result.allocator_peak_bytes <= budget
    assert all(t.makespan_us > 0 for t in traces)


def test_a_dispatched_step_between_replays_times_every_task_and_computes_the_same() -> None:
    """``Engine.run(dispatch=True)`` after replays (what ``dataflow train --trace-steps``
    does): that step has task spans, the replays around it continue, and every step's
    results are bit for bit those of plain dispatch."""
    dispatched, _, _, _, _ = _chain_steps(graph=False)
    mixed, traces, note, _, _ = _chain_steps(graph=True, dispatch_at=(2,))
    assert note is None, note
    assert [t.replayed for t in traces] == [False, True, False, True]
    assert len(traces[2].tasks) == len(chain.build_program(6, 1024, 4096).tasks)
    for step, (a, b) in enumerate(zip(dispatched, mixed, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs"


def test_uncapturable_executable_falls_back_with_a_reason() -> None:
    program = chain.build_program(3, 256, 512)
    values = chain.initial_values(program)
    planned = plan(program, 2**40)
    resolver = build(planned.program)

    class Opaque:  # no capturable attribute: the engine must not capture it
        def __init__(self, inner):
            self.inner = inner

        def launch(self, ctx):
            self.inner.launch(ctx)

    def wrapped(task):
        return Opaque(resolver(task))

    with Engine("torch", device="cuda", graph=True) as engine:
        engine.load(place(planned), wrapped, initial=values)
        with pytest.warns(RuntimeWarning, match="does not declare capturable"):
            result = engine.run(steps=3, feed=lambda _step: values)
    assert not any(t.replayed for t in result.steps)
    assert "capturable" in engine.graph_note and "\n" not in engine.graph_note


def _chain_reference(h0: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The chain's gradients by plain autograd on the CPU: g_0 and every dW_i."""
    h0 = h0.clone().requires_grad_(True)
    leaves = [w.clone().requires_grad_(True) for w in weights]
    h = h0
    for w in leaves:
        h = torch.tanh(h @ w)
    (0.5 * (h**2).sum()).backward()
    return {"g_0": h0.grad} | {f"dW_{i}": w.grad for i, w in enumerate(leaves)}


@pytest.mark.parametrize("graph", [False, True])
def test_a_new_input_fed_every_step_is_what_the_step_computes_on(graph: bool) -> None:
    """h_0 starts fast and is fed anew each step: the engine writes it asynchronously
    from a page-locked staging copy on the compute stream (``put_initial(per_step=True)``),
    so a step that read the last step's input, or a half-written one, would show here."""
    from dataflow.engine.backends.torch_cuda import runtime_reserve_bytes

    layers = 4
    program = chain.build_program(layers, 512, 2048, dtype="float64")
    start = chain.initial_values(program)
    weights = [start[f"W_{i}"] for i in range(layers)]
    inputs = [
        torch.randn(2048, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        for s in range(1, STEPS + 1)
    ]
    objects_bytes = minimal_budget(program)
    planned = plan(program, objects_bytes)
    budget = objects_bytes + runtime_reserve_bytes("cuda")
    with Engine("torch", budget_bytes=budget, device="cuda", graph=graph) as engine:
        first = start | {"h_0": inputs[0]}  # later steps' inputs come through the feed
        engine.load(place(planned), build(planned.program), initial=first)
        for step, h0 in enumerate(inputs):
            # the host tensor is overwritten right after the step: the engine must not
            # read it later than the call
            fed = h0.clone()
            result = engine.run(steps=1, feed=lambda _step, fed=fed: {"h_0": fed})
            fed.zero_()
            want = _chain_reference(h0, weights)
            for name, value in want.items():
                got = engine.fetch(name)
                torch.testing.assert_close(
                    got, value, rtol=1e-9, atol=1e-9, msg=f"step {step}: {name}"
                )
        assert result.steps[0].replayed is graph
        # h_0 went through its staging buffer (so may objects carried from the host)
        assert engine._backend.staging.buffers["h_0"].numel() == 2048 * 512 * 8


def _train(graph: bool, budget: int):
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.step.config import TrainConfig

    train = TrainConfig(seq_len=64, batch=4, rounds=2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with TrainingRun.of(
        "gpt2", "gpt2_tiny", train, budget_bytes=budget, device="cuda", graph=graph
    ) as run:
        for _ in range(STEPS):
            batches = [
                tuple(torch.randint(0, 256, (4, 64), generator=gen) for _ in range(2))
                for _ in range(2)
            ]
            losses.append(run.step(batches, lr=1e-3).losses)
        weights, _ = run.state()
        return losses, weights, run.graph_note, run.compiled.predicted()


def test_replayed_training_matches_dispatch() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        budget = 48 * 2**20
        plain_losses, plain_weights, _, _ = _train(False, budget)
        losses, weights, note, predicted = _train(True, budget)
    finally:
        torch.use_deterministic_algorithms(False)
    assert note is None, note
    assert losses == plain_losses
    for name, w in plain_weights.items():
        assert torch.equal(w, weights[name]), name


def test_a_capture_a_task_breaks_leaves_random_draws_working() -> None:
    """A task that syncs with the host (``.item()``) while the step is captured invalidates
    the capture: the engine dispatches instead, and torch's CUDA generators are left out of
    capture mode (a random draw afterwards raised "Offset increment outside graph capture
    encountered unexpectedly" before the engine mended them; H100, session 31)."""
    program = chain.build_program(3, 256, 512)
    values = chain.initial_values(program)
    planned = plan(program, 2**40)
    resolver = build(planned.program)

    class Syncs:  # declares itself capturable, then reads a value back to the host
        capturable = True

        def __init__(self, inner):
            self.inner = inner

        def launch(self, ctx):
            self.inner.launch(ctx)
            if ctx.outputs:
                ctx.outputs[0].sum().item()

    with Engine("torch", device="cuda", graph=True) as engine:
        engine.load(place(planned), lambda task: Syncs(resolver(task)), initial=values)
        with pytest.warns(RuntimeWarning, match="capture failed"):
            result = engine.run(steps=3, feed=lambda _step: values)
    assert not any(t.replayed for t in result.steps)
    draw = torch.randint(0, 1000, (64,), device="cuda")  # raised before the mend
    assert draw.shape == (64,)


def test_device_values_are_written_after_the_current_stream_s_work() -> None:
    """The per-step values' device copy is ordered after what the current stream still
    has queued: with the default stream held busy (a sleep kernel of tens of ms) when
    the buffer is made and written, the buffer ends with the values written, not with
    what the busy stream wrote into it. Before, a new buffer's zero fill on the default
    stream could land after the copy (nothing ordered them), and the first update read
    update 0 and lr 0."""
    from dataflow.engine.backends.torch_graph import DeviceValues

    device = torch.device("cuda")
    compute = torch.cuda.Stream(device=device)
    values = {"lr": 3e-4, "update": 1.0, "step": 0.0}
    torch.cuda.synchronize(device)
    torch.cuda._sleep(50_000_000)  # cycles: tens of ms on the current (default) stream
    made = DeviceValues(sorted(values), device)
    made.device_buffer.fill_(-1.0)  # queued behind the sleep, as a fill of a new buffer is
    tensors = made.update(values, compute)
    torch.cuda.synchronize(device)  # both streams done: the buffer holds what came last
    seen = [float(tensors[name]) for name in sorted(values)]
    assert seen == [pytest.approx(values[name]) for name in sorted(values)]
