"""``dataflow train --profile``: the window's checks, and on the CPU a torch.profiler
Chrome trace that covers exactly the asked-for steps, with the tasks' own ops in them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dataflow_training.drive.profiling import ProfileWindow

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")


def _train(tmp_path: Path, steps: int, *extra: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes() * 8)
    return invoke(
        *("train", "--preset", "gpt2_tiny", "--steps", str(steps), "--device", "cpu"),
        *("--data", f"text:{corpus}", "--batch", "2", "--seq-len", "16"),
        *("--out", str(tmp_path / "run"), *extra),
    )


def _steps(window: ProfileWindow) -> tuple[int, int]:
    return window.start, window.stop


def test_the_window_defaults_to_steps_5_to_8_or_what_the_run_has():
    assert _steps(ProfileWindow.checked(None, None, 100, "p")) == (5, 8)
    assert _steps(ProfileWindow.checked(None, None, 6, "p")) == (5, 6)
    assert _steps(ProfileWindow.checked(None, None, 2, "p")) == (2, 2)
    assert _steps(ProfileWindow.checked(3, None, 4, "p")) == (3, 4)
    assert ProfileWindow.checked(2, 2, 4, "p").trace_path == Path("p/trace_steps_2-2.json")


@pytest.mark.parametrize(
    ("start", "stop", "culprit", "why"),
    [
        (0, 3, "--profile-start-before-step 0", "count from 1"),
        (4, 3, "--profile-stop-after-step 3", "comes before --profile-start-before-step 4"),
        (2, 11, "--profile-stop-after-step 11", "past the last step (--steps 10)"),
        (11, None, "--profile-start-before-step 11", "past the last step (--steps 10)"),
    ],
)
def test_a_bad_window_is_a_usage_error_naming_the_option(start, stop, culprit, why, tmp_path):
    with pytest.raises(ValueError, match=culprit):
        ProfileWindow.checked(start, stop, 10, tmp_path)
    args = ["--profile", "--profile-start-before-step", str(start)]
    if stop is not None:
        args += ["--profile-stop-after-step", str(stop)]
    line = assert_one_line_error(_train(tmp_path, 10, *args), 2, culprit)
    assert why in line


def test_range_options_without_profile_are_a_usage_error(tmp_path):
    result = _train(tmp_path, 4, "--profile-stop-after-step", "3", "--prof-dir", "x")
    assert_one_line_error(result, 2, "--profile-stop-after-step, --prof-dir needs --profile")


def _spans(events: list[dict], prefix: str) -> dict[str, tuple[float, float]]:
    return {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e["name"].startswith(prefix)
    }


def test_cpu_trace_covers_exactly_the_window(tmp_path):
    prof = tmp_path / "prof"
    result = _train(
        tmp_path,
        6,
        *("--profile", "--profile-start-before-step", "3", "--profile-stop-after-step", "5"),
        *("--prof-dir", str(prof)),
    )
    assert result.exit_code == 0, result.output
    trace = prof / "trace_steps_3-5.json"
    assert f"profile: steps 3-5: a torch.profiler trace -> {trace}" in result.output
    assert "on the CPU: no NVTX ranges or CUDA profiler" in result.output
    assert f"profile: steps 3-5 traced to {trace}" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    steps = _spans(events, "dataflow step ")
    assert sorted(steps) == ["dataflow step 3", "dataflow step 4", "dataflow step 5"]
    ordered = [steps[f"dataflow step {n}"] for n in (3, 4, 5)]
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:], strict=False))
    # the tasks run on the CPU runner's worker thread: their matrix products are in the
    # trace, inside the steps' spans, and every step has its own
    products = [
        e
        for e in events
        if e.get("ph") == "X" and e["name"] in ("aten::mm", "aten::addmm", "aten::bmm")
    ]
    assert products, "no task ops in the trace"
    main_thread = events[[e.get("name") for e in events].index("dataflow step 3")]["tid"]
    assert any(e["tid"] != main_thread for e in products)
    for start, end in ordered:
        assert any(start <= e["ts"] <= end for e in products), (start, end)
    first, last = ordered[0][0], ordered[-1][1]
    assert all(first <= e["ts"] <= last for e in products)


def test_a_run_resumed_past_the_window_traces_nothing_and_says_so(tmp_path):
    assert _train(tmp_path, 3).exit_code == 0
    window = ("--profile", "--profile-start-before-step", "2", "--profile-stop-after-step", "3")
    result = _train(tmp_path, 5, "--resume", "auto", *window)
    assert result.exit_code == 0, result.output
    assert "profile: steps 2-3 ran before step 3, where this run resumes: nothing to trace" in (
        result.output
    )
    assert not (tmp_path / "run" / "profile").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["--no-graph", "--graph"])
def test_cuda_profile_window_pushes_nvtx_ranges_and_starts_the_cuda_profiler_once(
    tmp_path, monkeypatch, graph
):
    """On CUDA, in-process so that the NVTX and CUDA-profiler calls can be watched: one
    cudaProfilerStart before step 2 and one stop after step 3, a range per step and
    (dispatched steps, ``--no-graph``) per task launch only inside the window, balanced.
    Steps replayed from a CUDA graph launch no task from the host: step ranges only."""
    import torch

    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append(("start", None)))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append(("stop", None)))
    result = invoke(
        *("train", "--preset", "gpt2_tiny", "--steps", "4", "--device", "cuda"),
        *("--budget", "1GiB", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path / "run")),
        *("--profile", "--profile-start-before-step", "2", "--profile-stop-after-step", "3"),
        graph,
    )
    assert result.exit_code == 0, result.output
    kinds = [kind for kind, _ in calls]
    assert kinds[0] == "start" and kinds[-1] == "stop" and kinds.count("start") == 1
    assert kinds.count("push") == kinds.count("pop")
    pushed = [name for kind, name in calls if kind == "push"]
    steps = [name for name in pushed if name.startswith("dataflow step ")]
    assert steps == ["dataflow step 2", "dataflow step 3"]
    tasks = [name for name in pushed if not name.startswith("dataflow step ")]
    if graph == "--graph":
        assert tasks == [], "replayed steps launch no task from the host"
        assert "per-step ranges, no per-task ones" in result.output
        return
    assert tasks and len(tasks) % 2 == 0  # the same tasks in each of the two steps
    assert tasks[: len(tasks) // 2] == tasks[len(tasks) // 2 :]
    assert any(name.startswith("fwd_") for name in tasks)
    assert any(name.startswith("opt_") for name in tasks)


@pytest.mark.gpu
def test_cuda_profile_window_traces_kernels_and_names_tasks(tmp_path):
    """On CUDA: the trace has the window's kernels, and the runner is back to no NVTX
    ranges afterwards (run under nsys by hand to see the ranges themselves)."""
    from dataflow import CudaRunner

    prof = tmp_path / "prof"
    result = invoke(
        *("train", "--preset", "gpt2_tiny", "--steps", "4", "--device", "cuda"),
        *("--budget", "1GiB", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path / "run")),
        *("--profile", "--profile-start-before-step", "2", "--profile-stop-after-step", "3"),
        *("--prof-dir", str(prof)),
    )
    assert result.exit_code == 0, result.output
    assert "cudaProfilerStart/Stop" in result.output
    events = json.loads((prof / "trace_steps_2-3.json").read_text())["traceEvents"]
    assert sorted(_spans(events, "dataflow step ")) == ["dataflow step 2", "dataflow step 3"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert CudaRunner.nvtx_ranges is False
