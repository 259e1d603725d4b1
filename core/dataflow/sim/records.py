"""What a simulated run records: when each task and transfer ran, and each link's load."""

from __future__ import annotations

import attrs


@attrs.frozen
class TaskTiming:
    """One task's run on the compute resource."""

    task_id: str
    start_us: float
    end_us: float


@attrs.frozen
class TransferTiming:
    """One transfer: enqueued by ``enqueued_by``'s directive, queued, then run on its link.

    ``direction`` is ``"h2d"`` (a prefetch) or ``"d2h"`` (the write-back of a dirty offload).
    """

    obj_id: str
    direction: str
    size_bytes: int
    enqueued_by: str
    enqueue_us: float
    start_us: float
    end_us: float

    @property
    def wait_us(self) -> float:
        """Time spent queued: behind other transfers or waiting for room."""
        return self.start_us - self.enqueue_us


@attrs.frozen
class LinkStats:
    """Load of one link over a run: transfers that ended, their bytes and busy time.

    ``busy_fraction`` is ``busy_us / makespan_us`` (0 for an empty run).
    """

    direction: str
    transfers: int
    bytes: int
    busy_us: float
    busy_fraction: float
