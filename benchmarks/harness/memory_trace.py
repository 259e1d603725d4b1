"""What is alive at a CUDA call's allocation peak: one call under the allocator's
history (``torch.cuda.memory._record_memory_history``), its allocations and frees
replayed to the moment the most bytes were alive, each block alive then with its size and
the lines that allocated it. Used by the probes (``probes/ce_peak.py``,
``probes/task_capture.py``)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch


@attrs.frozen
class Peak:
    """``above``: the allocator's peak during the call above what was in use before it;
    ``most``: the most bytes alive at once in the trace; ``blocks``: (size, the allocating
    lines, innermost first) of each block alive then, largest first."""

    above: int
    most: int
    blocks: list[tuple[int, list[str]]]

    def lines(self, top: int = 12) -> list[str]:
        """The report: the two totals, then the ``top`` largest blocks."""
        out = [
            f"allocator peak above the bytes in use before: {self.above}",
            f"most bytes alive in the trace: {self.most}",
        ]
        out += [f"{size:>14,}  {' <- '.join(where[:3])}" for size, where in self.blocks[:top]]
        return out


def call_peak(call: Callable[[], object], keep: Callable[[str], bool]) -> Peak:
    """One ``call`` (warm it first: a library's first call allocates what it keeps) traced;
    ``keep(filename)`` picks the stack frames named for each block (the project's)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    outputs = call()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del outputs
    above = torch.cuda.max_memory_allocated() - before
    alive: dict[int, dict] = {}
    now = most = 0
    at_most: list[dict] = []
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            now += event["size"]
            if now > most:
                most, at_most = now, list(alive.values())
        elif event["action"] == "free_requested" and event["addr"] in alive:
            now -= alive.pop(event["addr"])["size"]
    blocks = [
        (
            event["size"],
            [
                f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
                for frame in event.get("frames", [])
                if keep(frame["filename"])
            ],
        )
        for event in sorted(at_most, key=lambda e: -e["size"])
    ]
    return Peak(above, most, blocks)
