"""``dataflow export --preset`` and ``dataflow train --trace-steps`` on gpt2_tiny: the
bundle's program reproduces its predicted timeline, its placement is sound, the measured
timeline covers every task, the Perfetto trace is sound trace-event JSON; bad options
are one line naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow import Program, read_bundle, simulate
from dataflow.testing import (
    FAILURE_EXIT,
    USAGE_EXIT,
    assert_one_line_error,
    invoke,
    trace_event_problems,
)

pytest.importorskip("dataflow_family_gpt2")

SHAPE = ("--preset", "gpt2_tiny", "--batch", "2", "--seq-len", "32")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    result = invoke(
        "export", *SHAPE, "--ga-rounds", "2", "--budget", "2MiB", "--pricing", "roofline",
        "-o", out, "--perfetto", out / "trace.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_the_exact_program_reproduces_the_predicted_timeline(exported: Path) -> None:
    bundle = read_bundle(exported)
    assert bundle.program == Program.from_json(exported / "program.json")
    sim = simulate(bundle.program, budget_bytes=bundle.plan.planned_budget_bytes)
    assert sim.valid
    spans = [(t.task_id, t.start_us, t.end_us) for t in sim.tasks]
    assert spans == [(s.task_id, s.start_us, s.end_us) for s in bundle.timeline.tasks]
    summary = bundle.summary
    assert summary.step_s == pytest.approx(sim.makespan_us / 1e6)
    assert summary.fast_peak_bytes == sim.fast_peak_bytes <= 2 * 2**20
    assert summary.moved_bytes == {"h2d": sim.h2d.bytes, "d2h": sim.d2h.bytes}
    assert summary.tok_s == pytest.approx(2 * 32 * 2 / summary.step_s)
    assert (summary.pricing, summary.hw, summary.preset, summary.family) == (
        "roofline", "h200", "gpt2_tiny", "gpt2",
    )  # fmt: skip
    assert summary.shape["rounds"] == 2 and summary.shape["tokens_step"] == 128


def test_the_placement_never_puts_two_live_blocks_at_one_address(exported: Path) -> None:
    placement = read_bundle(exported).plan.placement
    blocks = placement.blocks
    assert blocks and max(b.offset_bytes + b.size_bytes for b in blocks) <= placement.arena_bytes
    for i, a in enumerate(blocks):
        for b in blocks[i + 1 :]:
            if a.start_us < b.end_us and b.start_us < a.end_us:  # live at one time
                apart = a.offset_bytes + a.size_bytes <= b.offset_bytes or (
                    b.offset_bytes + b.size_bytes <= a.offset_bytes
                )
                assert apart, (a, b)


def test_the_directives_are_those_of_the_program(exported: Path) -> None:
    bundle = read_bundle(exported)
    for task in bundle.program.tasks:
        recorded = bundle.plan.directives.get(task.id)
        if task.releases or task.offloads or task.prefetches:
            assert recorded is not None
            assert (recorded.releases, recorded.offloads, recorded.prefetches) == (
                task.releases, task.offloads, task.prefetches,
            )  # fmt: skip
        else:
            assert recorded is None


def test_the_exported_perfetto_trace_is_sound(exported: Path) -> None:
    document = json.loads((exported / "trace.json").read_text())
    assert trace_event_problems(document) == []


def test_tokens_step_sets_the_rounds(tmp_path: Path) -> None:
    result = invoke(
        "export", *SHAPE, "--tokens-step", "256", "--budget", "4MiB", "--pricing", "roofline",
        "-o", tmp_path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert read_bundle(tmp_path).summary.shape["rounds"] == 4


@pytest.mark.parametrize(
    ("args", "code", "culprits"),
    [
        (("--ga-rounds", "2", "-o", "X"), USAGE_EXIT, ("--budget",)),
        (("--ga-rounds", "2", "--tokens-step", "128", "--budget", "2MiB", "-o", "X"),
         USAGE_EXIT, ("--ga-rounds", "--tokens-step")),
        (("--tokens-step", "100", "--budget", "2MiB", "-o", "X"), USAGE_EXIT, ("--tokens-step",)),
        (("--budget", "64KiB", "--pricing", "roofline", "-o", "X"), FAILURE_EXIT, ("--budget",)),
        (("--budget", "2MiB", "--hw", "nope", "-o", "X"), USAGE_EXIT, ("--hw", "nope")),
        (("--budget", "2MiB", "--hf", "H"), USAGE_EXIT, ("--hf", "--preset")),
    ],
)  # fmt: skip
def test_bad_options_are_one_line(tmp_path: Path, args, code, culprits) -> None:
    args = [str(tmp_path / a) if a in ("X", "H") else a for a in args]
    assert_one_line_error(invoke("export", *SHAPE, *args), code, *culprits)


def test_hf_needs_from(tmp_path: Path) -> None:
    assert_one_line_error(invoke("export", "--hf", tmp_path / "h"), USAGE_EXIT, "--from")


def _train(out: Path, *extra: str):
    return invoke(
        "train", *SHAPE, "--ga-rounds", "2", "--steps", "3", "--budget", "2MiB",
        "--device", "cpu", "--out", out, *extra,
    )  # fmt: skip


def test_train_trace_steps_writes_the_run_bundle(tmp_path: Path) -> None:
    result = _train(tmp_path, "--trace-steps", "2")
    assert result.exit_code == 0, result.output
    assert "bundle:" in result.output
    bundle = read_bundle(tmp_path)
    measured = bundle.measured
    assert measured is not None
    assert [s.task_id for s in measured.tasks] == [t.id for t in bundle.program.tasks]
    assert all(s.args["measured_us"] > 0 for s in measured.tasks)
    assert len(measured.metadata["step_makespans_us"]) == 2
    assert bundle.summary.measured.steps == 2  # the dispatched steps after the first
    assert bundle.summary.measured.device == "cpu"
    assert bundle.summary.pricing == "profiled"  # as the run priced it, on the CPU too
    document = json.loads((tmp_path / "perfetto.json").read_text())
    assert trace_event_problems(document) == []
    assert {e["pid"] for e in document["traceEvents"] if e["ph"] == "X"} == {1, 2}


def test_trace_steps_beyond_the_run_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(_train(tmp_path, "--trace-steps", "4"), USAGE_EXIT, "--trace-steps")


@pytest.mark.gpu
def test_train_trace_steps_on_cuda_times_dispatched_steps_after_replays(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    result = invoke(
        "train", *SHAPE, "--ga-rounds", "2", "--steps", "6", "--budget", "1GiB",
        "--device", "cuda", "--dtype", "bf16", "--out", tmp_path, "--trace-steps", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    bundle = read_bundle(tmp_path)
    assert bundle.summary.measured.replayed  # the untraced steps were graph replays
    assert bundle.measured.metadata["replayed_steps"] == []  # the traced ones were not
    assert [s.task_id for s in bundle.measured.tasks] == [t.id for t in bundle.program.tasks]
    assert bundle.summary.pricing == "profiled"
