"""The discrete-event simulator: docs/execution_model.md, priced.

``simulate(program)`` runs an annotated Program exactly as the engine would and returns a
``SimResult`` (validity, makespan, peaks, link load, compute idle time, and a timeline
that exports to Chrome trace-event JSON). Pure Python: no torch.
"""

from dataflow.sim.failure import FailureKind, InvalidProgramError, SimError
from dataflow.sim.records import LinkStats, TaskTiming, TransferTiming
from dataflow.sim.result import SimResult
from dataflow.sim.simulate import simulate

__all__ = [
    "FailureKind",
    "InvalidProgramError",
    "LinkStats",
    "SimError",
    "SimResult",
    "TaskTiming",
    "TransferTiming",
    "simulate",
]
