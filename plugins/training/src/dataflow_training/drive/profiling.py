"""``dataflow train --profile``: what happens during the profiled steps.

A window of steps, ``start`` to ``stop`` (1-based, both included; warmed steps, so not
step 1, which also loads the engine), is bracketed three ways:

- a torch.profiler Chrome trace of exactly those steps, written to the profile folder
  (open it in Perfetto or ``chrome://tracing``); each step is a ``dataflow step N`` range
  in it, and the tasks' own torch ops are there (on CUDA, with their kernels);
- on CUDA, ``torch.cuda.profiler.start()`` before the first and ``stop()`` after the last
  (for ``nsys profile --capture-range=cudaProfilerApi``), an NVTX range per step and one
  per task launch (``CudaRunner.nvtx_ranges``), so Nsight Systems shows each task's
  kernels under its id;
- on the CPU there is no NVTX and no CUDA profiler; the run says so.

Steps replayed from a CUDA graph (the default on CUDA after the first) launch no task
from the host, so they carry the per-step NVTX range and all their kernels, but no
per-task ranges; ``--no-graph`` dispatches every task and gives them back.

Steps outside the window run exactly as without ``--profile``. This is not
``dataflow_training.plan.profile``, which measures tasks' costs for the planner.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import attrs

#: the window when only ``--profile`` is given: steps 5-8, or as much of it as the run has
DEFAULT_START, DEFAULT_STEPS = 5, 4


@attrs.frozen
class ProfileWindow:
    """Steps ``start`` .. ``stop`` (1-based, inclusive), traced into ``folder``."""

    start: int
    stop: int
    folder: Path = attrs.field(converter=Path)

    @classmethod
    def checked(
        cls, start: int | None, stop: int | None, steps: int, folder: str | Path
    ) -> ProfileWindow:
        """The window the ``--profile-*`` options ask for in a run of ``steps``; an error
        naming the option when it cannot be. Left out, ``start`` is step 5 (or the last
        step of a shorter run) and ``stop`` three steps later (or the last step)."""
        if start is None:
            start = min(DEFAULT_START, steps)
        if stop is None:
            stop = min(start + DEFAULT_STEPS - 1, steps)
        if start < 1:
            raise ValueError(f"--profile-start-before-step {start}: steps count from 1")
        if start > steps:
            raise ValueError(
                f"--profile-start-before-step {start} is past the last step (--steps {steps})"
            )
        if stop < start:
            raise ValueError(
                f"--profile-stop-after-step {stop} comes before --profile-start-before-step {start}"
            )
        if stop > steps:
            raise ValueError(
                f"--profile-stop-after-step {stop} is past the last step (--steps {steps})"
            )
        return cls(start, stop, folder)

    @property
    def trace_path(self) -> Path:
        return self.folder / f"trace_steps_{self.start}-{self.stop}.json"


class StepProfiler:
    """Wraps each step of a run (``with profiler.step(n): ...``); does its work only for
    the steps of ``window``. A run resumed past ``window.start`` profiles the window's
    steps it still runs."""

    def __init__(
        self, window: ProfileWindow, device: str, out: TextIO | None = None, graph: bool = False
    ) -> None:
        self.window, self.out = window, out
        self.cuda = device.startswith("cuda")
        self.graph = graph and self.cuda
        self._torch: Any = None  # the torch.profiler.profile while the window is open
        self.steps: list[int] = []  # the steps traced so far

    def describe(self) -> str:
        w = self.window
        tools = "a torch.profiler trace"
        if self.cuda:
            tools += ", cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi), NVTX"
        line = f"profile: steps {w.start}-{w.stop}: {tools} -> {w.trace_path}"
        if not self.cuda:
            line += " (on the CPU: no NVTX ranges or CUDA profiler)"
        elif self.graph:
            line += " (steps replayed from a CUDA graph: per-step ranges, no per-task ones; --no-graph for those)"
        return line

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step ``step`` (1-based) inside the window's instruments when it is in it."""
        w = self.window
        if not w.start <= step <= w.stop:
            yield
            return
        # torch loads when a profile window opens: `dataflow train` reads this module without it
        import torch

        if self._torch is None:
            self._open()
        self.steps.append(step)
        name = f"dataflow step {step}"
        if self.cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.profiler.record_function(name):
                yield
                if self.cuda:
                    torch.cuda.synchronize()
        finally:
            if self.cuda:
                torch.cuda.nvtx.range_pop()
        if step == w.stop:
            self.close()

    def _open(self) -> None:
        # torch loads when a profile window opens: `dataflow train` reads this module without it
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.cuda:
            # torch loads when a profile window opens: `dataflow train` reads this module without it
            from dataflow import CudaRunner

            activities.append(ProfilerActivity.CUDA)
            CudaRunner.nvtx_ranges = True
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        self._torch = profile(activities=activities, experimental_config=_all_threads())
        self._torch.start()

    def close(self) -> Path | None:
        """End the window (at its last step, or early when the run stops inside it) and
        write the trace of the steps it saw; the trace's path, or None when it saw none."""
        if self._torch is None:
            return None
        # torch loads when a profile window opens: `dataflow train` reads this module without it
        import torch

        if self.cuda:
            # torch loads when a profile window opens: `dataflow train` reads this module without it
            from dataflow import CudaRunner

            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            CudaRunner.nvtx_ranges = False
        self._torch.stop()
        path = self.window.trace_path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._torch.export_chrome_trace(str(path))
        self._torch = None
        done = f"{self.steps[0]}-{self.steps[-1]}"
        # resolved now, not at the start: a progress bar may have taken stdout over since
        print(f"profile: steps {done} traced to {path}", file=self.out or sys.stdout, flush=True)
        return path


def _all_threads() -> Any:
    """The profiler's setting to record every thread, not only the one that starts it:
    the CPU runner launches tasks on worker threads. Experimental in torch; None (the
    starting thread only) where this torch does not have it."""
    try:
        # torch loads when a profile window opens: `dataflow train` reads this module without it
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None
