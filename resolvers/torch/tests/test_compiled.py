"""The compiled resolver gives what the eager one gives (CUDA: inductor's home), through
the CUDA graph the steps after the first replay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dataflow import resolvers


def test_both_resolvers_are_registered() -> None:
    names = resolvers().names()
    assert "torch" in names and "torch-compiled" in names


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family_name", "preset"),
    # llama3: RoPE tables are traced inside the compiled task and must not copy from the
    # host while the step is captured into a CUDA graph
    # olmoe, qwen3_moe in float32: grouped_mm's reference loop reads its offsets on the
    # host, so the profiling pass keeps the dispatched timing and the engine dispatches
    # (the bfloat16 test below is the captured grouped GEMM)
    [
        ("gpt2", "gpt2_tiny"),
        ("llama3", "llama3_tiny"),
        ("olmoe", "olmoe_tiny"),
        ("qwen3_moe", "qwen3_moe_tiny"),
    ],
)
def test_compiled_tiny_steps_match_the_reference_on_cuda(family_name: str, preset: str) -> None:
    pytest.importorskip(f"dataflow_family_{family_name}")
    torch.backends.cuda.matmul.allow_tf32 = False
    failed = _failed_step_checks(family_name, preset, "fp32")
    assert not failed, failed


def _failed_step_checks(family_name: str, preset: str, policy: str, device: str = "cuda") -> list:
    """``dataflow verify``'s step checks of two compiled steps on ``device`` that failed."""
    from dataflow_training import TOLERANCES, step_checks

    from dataflow import families

    checks = step_checks(
        families().get(family_name).load(),
        preset,
        device=device,
        policy=policy,
        steps=2,
        rounds=2,
        batch=2,
        seq_len=16,
        budget_bytes=None,
        seed=0,
        tolerance=TOLERANCES[policy]["step"],
        resolver="torch-compiled",
    )
    return [check for check in checks if not check.ok]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family_name", "preset"), [("olmoe", "olmoe_tiny"), ("qwen3_moe", "qwen3_moe_tiny")]
)
def test_compiled_moe_steps_in_bf16_are_captured_and_match_the_reference(
    family_name: str, preset: str
) -> None:
    """The MoE block in bfloat16 (routing sorted by expert, ``torch._grouped_mm`` over
    device offsets) under torch.compile: the steps after the first replay one captured CUDA
    graph, and they match the reference at the bf16 step tolerance. benchmarks/model_rows.sh
    runs the MoE rows eager until this passes on the device."""
    pytest.importorskip(f"dataflow_family_{family_name}")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow_training import DtypePolicy, TrainConfig, TrainingRun

    from dataflow import families

    failed = _failed_step_checks(family_name, preset, "bf16")
    assert not failed, failed
    family = families().get(family_name).load()
    train = TrainConfig(seq_len=16, batch=2, rounds=2, dtype=DtypePolicy.named("bf16"))
    run = TrainingRun.of(family, preset, train, device="cuda", resolver="torch-compiled", seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = run.vocab_size
    batches = [
        (
            torch.randint(0, vocab, (2, 16), generator=g),
            torch.randint(0, vocab, (2, 16), generator=g),
        )
        for _ in range(2)
    ]
    losses = [run.step(batches).loss for _ in range(3)]
    assert run.graph_note is None, run.graph_note  # replayed, not dispatched
    assert all(torch.isfinite(torch.tensor(losses)))
    run.close(keep_state=False)


@pytest.mark.parametrize(
    ("family_name", "preset", "whole"),
    # olmoe on the CPU: the grouped GEMM's reference loop reads the expert offsets on the
    # host, a graph break by design (on CUDA, bfloat16 runs torch._grouped_mm in-graph)
    [("gpt2", "gpt2_tiny", True), ("llama3", "llama3_tiny", True), ("olmoe", "olmoe_tiny", False)],
)
def test_compiled_blocks_write_their_views_inside_the_graph_on_cpu(
    monkeypatch, family_name: str, preset: str, whole: bool
) -> None:
    """Each block function is compiled with the writes of what it returns into the task's
    views (``Strategy.run_into``): dynamo and AOT autograd trace the writes, into views
    sharing one packed object's storage, as input mutations of the graph. ``aot_eager``
    traces what inductor would compile without generating code: the steps match the
    float64 reference and each block function is one graph, writes included (a graph
    break splits the fusion; the kit's frozen op classes, the kernels' build checks and
    the decoder's attention half each caused one); olmoe's Aux counts and AuxTemp routing
    are written the same way."""
    pytest.importorskip(f"dataflow_family_{family_name}")
    from dataflow_resolver_torch import compiled
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    failed = _failed_step_checks(family_name, preset, "fp32", device="cpu")
    assert not failed, failed
    assert counters["stats"]["unique_graphs"] >= 2  # forward and backward at least
    assert not counters["recompile_limit"] and not counters["cache_size_limit"]
    if whole:
        assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_verify_runs_its_step_level_on_the_compiled_resolver(monkeypatch) -> None:
    """``verify(resolver=...)`` (``dataflow verify --resolver``) hands the step level's
    engine to the named resolver: the compiled blocks' graphs are made (and pass), where
    the default eager resolver makes none."""
    pytest.importorskip("dataflow_family_llama3")
    from dataflow_resolver_torch import compiled
    from dataflow_training import verify
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    small = {"steps": 1, "rounds": 1, "batch": 1, "seq_len": 8, "levels": ("step",)}
    for resolver, graphs in (("torch", 0), ("torch-compiled", 2)):
        torch._dynamo.reset()
        counters.clear()
        checks = verify("llama3", "llama3_tiny", resolver=resolver, **small)
        assert checks and all(check.ok for check in checks), [c for c in checks if not c.ok]
        made = counters["stats"]["unique_graphs"]
        assert made >= graphs if graphs else made == 0, (resolver, made)
    torch._dynamo.reset()


def test_views_of_one_arena_in_several_dtypes_are_written_inside_a_graph() -> None:
    """The CUDA engine's tensors are views of one byte arena; a compiled block writes
    bf16 views beside a float32 one. Given storages of their own (``own_storage``), AOT
    autograd takes them as separate inputs (over the plain views it refuses, as of torch
    2.13, "input mutations on views with different dtypes"), and the writes land in the
    arena's bytes."""
    from dataflow_resolver_torch.compiled import _own_storages

    arena = torch.zeros(8192, dtype=torch.uint8)
    views = [
        arena[0:2048].view(torch.bfloat16),
        arena[2048:3072].view(torch.float32),
        arena[3072:5120].view(torch.bfloat16),
    ]

    def write(puts, source):
        for target in puts:
            target.copy_(source[: target.numel()].to(target.dtype) * 2)

    torch._dynamo.reset()
    compiled = torch.compile(write, backend="aot_eager")
    compiled(*_own_storages((views, torch.arange(1024.0))))
    for view in views:
        assert torch.equal(view, (2 * torch.arange(float(view.numel()))).to(view.dtype))
    assert torch.count_nonzero(arena[5120:]) == 0  # nothing written past the views
    torch._dynamo.reset()


def test_each_compiled_block_function_has_a_code_object_of_its_own() -> None:
    """dynamo counts recompilations per code object (limit 8): the writing wrappers of
    every kind's functions must not share one."""
    from dataflow_resolver_torch.compiled import CompiledStrategy

    class Math:
        def forward(self, *args):
            return args

        def backward(self, *args):
            return args

    strategy = CompiledStrategy("aot_eager")
    wrappers = [
        strategy.block_math(kind, Math()).into[name]
        for kind in ("dense", "moe")
        for name in ("forward", "backward")
    ]
    codes = {id(w._torchdynamo_orig_callable.__code__) for w in wrappers}
    assert len(codes) == 4
    assert wrappers[0]._torchdynamo_orig_callable.__name__ == "dense_forward_and_writes"


@pytest.mark.parametrize(
    ("family_name", "preset"), [("olmoe", "olmoe_tiny"), ("qwen3_5_moe", "qwen3_5_moe_tiny")]
)
def test_routing_tasks_of_experts_run_apart_are_compiled_and_train_as_eager(
    monkeypatch, family_name: str, preset: str
) -> None:
    """A block whose experts run in shards: its routing tasks (``route_forward``,
    ``route_recompute``, ``route_backward``) run compiled, each kind's function under a
    code object of its own, and the steps train as the eager resolver's do to float32
    rounding (``aot_eager`` traces what inductor would compile)."""
    pytest.importorskip(f"dataflow_family_{family_name}")
    from dataflow_resolver_torch import compiled
    from dataflow_training import TrainConfig

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    called: list[str] = []
    on_own_storages = compiled._on_own_storages

    def recording(function):
        run = on_own_storages(function)
        name = function._torchdynamo_orig_callable.__name__

        def spy(*args):
            called.append(name)
            return run(*args)

        return spy

    monkeypatch.setattr(compiled, "_on_own_storages", recording)
    torch._dynamo.reset()
    train = TrainConfig(seq_len=8, batch=2, rounds=2)
    runs = _eager_and_compiled(family_name, preset, train)
    for want, got in _paired_losses(runs, steps=2):
        assert torch.tensor(got) == pytest.approx(torch.tensor(want), rel=1e-5)
    assert {name.rpartition("_route_")[2] for name in called} >= {"forward", "backward"}
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family_name", "preset"), [("olmoe", "olmoe_tiny"), ("qwen3_5_moe", "qwen3_5_moe_tiny")]
)
def test_routing_tasks_compiled_by_inductor_on_cuda_are_captured_and_train_as_eager(
    family_name: str, preset: str
) -> None:
    """On CUDA in bfloat16, inductor's code for the routing tasks of experts in two shards:
    the steps after the first replay one captured CUDA graph and train as the eager
    resolver's steps do to bf16 rounding (rel 2e-2, as the sharded step against the whole
    one) over three steps, the routing new each step."""
    pytest.importorskip(f"dataflow_family_{family_name}")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow_training import DtypePolicy, TrainConfig

    torch._dynamo.reset()
    train = TrainConfig(seq_len=16, batch=2, rounds=2, dtype=DtypePolicy.named("bf16"))
    runs = _eager_and_compiled(family_name, preset, train, device="cuda")
    for want, got in _paired_losses(runs, steps=3):
        assert torch.isfinite(torch.tensor(got)).all(), got
        assert torch.tensor(got) == pytest.approx(torch.tensor(want), rel=2e-2)
    assert runs["torch-compiled"].graph_note is None, runs["torch-compiled"].graph_note
    for run in runs.values():
        run.close(keep_state=False)
    torch._dynamo.reset()


def _eager_and_compiled(family_name: str, preset: str, train: Any, device: str = "cpu") -> dict:
    """The eager (``torch``) and ``torch-compiled`` runs of ``preset`` with its experts in
    two shards, from the same weights."""
    from dataflow_training import TrainingRun

    return {
        name: TrainingRun.of(
            family_name,
            preset,
            train,
            overrides={"expert_shards": 2},
            budget_bytes=None,
            device=device,
            seed=1,
            resolver=name,
        )  # fmt: skip
        for name in ("torch", "torch-compiled")
    }


def _paired_losses(runs: dict, steps: int) -> Iterator[tuple[list, list]]:
    """Each step's (eager, compiled) losses of ``runs`` (``_eager_and_compiled``) over the
    same random batches of their step's shape."""
    g = torch.Generator().manual_seed(0)
    vocab, train = runs["torch"].vocab_size, runs["torch"].train
    for _ in range(steps):
        batches = [
            tuple(  # tokens and targets
                torch.randint(0, vocab, (train.batch, train.seq_len), generator=g) for _ in range(2)
            )
            for _ in range(train.rounds)
        ]
        yield tuple(runs[name].step(batches).losses for name in ("torch", "torch-compiled"))
