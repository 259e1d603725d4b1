"""Progress of the verify ladder as it goes: which level runs, and how its checks came out.

``verify(..., progress=callback)`` calls ``callback(level, None)`` when a level starts and
``callback(level, checks)`` when it is done. ``LevelPrinter`` is the callback the
``dataflow verify`` command uses: one line per event, on stderr, so the table on stdout
stays clean. A callback with a ``note(text)`` method is also told what the step level
planned (``LevelPrinter`` prints it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

#: What each level compares, for the line that says it has started.
LEVEL_WHAT = {
    "op": "each op against a float64 formula",
    "task": "each layer kind's forward, recompute and backward against autograd",
    "step": "whole training steps on the engine against the reference model",
}

#: ``callback(level, None)`` at a level's start, ``callback(level, checks)`` at its end.
ProgressCallback = Callable[[str, Sequence[Any] | None], None]


class LevelPrinter:
    """Prints ``op: each op against ...`` then ``op: 12 checks, 12 passed in 0.4 s``."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        self._started: dict[str, float] = {}

    def __call__(self, level: str, checks: Sequence[Any] | None) -> None:
        out = self.out or sys.stderr
        if checks is None:
            self._started[level] = time.perf_counter()
            print(f"{level}: {LEVEL_WHAT.get(level, 'checks')} ...", file=out, flush=True)
            return
        seconds = time.perf_counter() - self._started.pop(level, time.perf_counter())
        failed = sum(not check.ok for check in checks)
        verdict = f"{len(checks) - failed} passed" + (f", {failed} FAILED" if failed else "")
        print(f"{level}: {len(checks)} checks, {verdict} in {seconds:.1f} s", file=out, flush=True)

    def note(self, text: str) -> None:
        print(f"  {text}", file=self.out or sys.stderr, flush=True)
