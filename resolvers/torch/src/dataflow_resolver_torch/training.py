"""The ``torch`` resolver: the training plugin's executables, run eagerly.

Every executable lives in ``dataflow_training.drive.tasks``; this package only chooses how they
run (``Strategy``), so a new family never touches a resolver.
"""

from __future__ import annotations

from typing import Any

from dataflow_training.drive import Strategy, TrainingTasks


class TrainingResolver(TrainingTasks):
    """Eager: each task's math runs op by op as the family wrote it."""

    name = "torch"

    def __init__(self, step: Any, *, ops: Any = None, strategy: Any = None) -> None:
        super().__init__(step, ops=ops, strategy=strategy or Strategy())
