"""The engine's ledger: where every object's copies are and how many bytes are in use.

States follow docs/execution_model.md: a fast copy is absent, incoming or resident; a slow
copy is absent, current or stale; a slow copy keeps its space once it has one.
"""

from __future__ import annotations

import enum

from dataflow.schema import Location, Program


class Fast(enum.IntEnum):
    ABSENT = 0
    INCOMING = 1
    RESIDENT = 2


class Slow(enum.IntEnum):
    ABSENT = 0
    CURRENT = 1
    STALE = 2


class Ledger:
    """Per-object state plus fast/slow bytes in use and their peaks."""

    def __init__(
        self, program: Program, fast_budget_bytes: int | None, slow_budget_bytes: int | None
    ):
        self.program = program
        self.fast_budget_bytes = fast_budget_bytes
        self.slow_budget_bytes = slow_budget_bytes
        self.size = {obj.id: obj.size_bytes for obj in program.objects}
        self.fast: dict[str, Fast] = dict.fromkeys(self.size, Fast.ABSENT)
        self.slow: dict[str, Slow] = dict.fromkeys(self.size, Slow.ABSENT)
        self.slow_space: set[str] = set()
        self.offload_pending: set[str] = set()
        self.fast_used_bytes = 0
        self.slow_used_bytes = 0
        backed = program.backed_ids
        for obj in program.objects:
            if not program.exists_at_start(obj.id):
                continue
            if obj.location is Location.FAST:
                self.fast[obj.id] = Fast.RESIDENT
                self.fast_used_bytes += obj.size_bytes
            if obj.location is Location.SLOW or obj.id in backed:
                self.slow[obj.id] = Slow.CURRENT
                self.slow_space.add(obj.id)
                self.slow_used_bytes += obj.size_bytes
        self.fast_peak_bytes = self.fast_used_bytes
        self.slow_peak_bytes = self.slow_used_bytes

    # -- fast bytes --------------------------------------------------------------------
    def fits_fast(self, size_bytes: int) -> bool:
        budget = self.fast_budget_bytes
        return budget is None or self.fast_used_bytes + size_bytes <= budget

    def reserve_fast(self, size_bytes: int) -> None:
        self.fast_used_bytes += size_bytes
        self.fast_peak_bytes = max(self.fast_peak_bytes, self.fast_used_bytes)

    def free_fast(self, size_bytes: int) -> None:
        self.fast_used_bytes -= size_bytes

    # -- slow bytes --------------------------------------------------------------------
    def slow_space_ready(self, obj: str) -> bool:
        budget = self.slow_budget_bytes
        return (
            obj in self.slow_space
            or budget is None
            or self.slow_used_bytes + self.size[obj] <= budget
        )

    def ensure_slow_space(self, obj: str) -> None:
        if obj not in self.slow_space:
            self.slow_space.add(obj)
            self.slow_used_bytes += self.size[obj]
            self.slow_peak_bytes = max(self.slow_peak_bytes, self.slow_used_bytes)

    # -- object transitions ------------------------------------------------------------
    def is_clean(self, obj: str) -> bool:
        return self.slow[obj] is Slow.CURRENT

    def drop_fast(self, obj: str) -> None:
        self.fast[obj] = Fast.ABSENT
        self.free_fast(self.size[obj])

    def make_dirty(self, obj: str) -> None:
        if self.slow[obj] is Slow.CURRENT:
            self.slow[obj] = Slow.STALE

    def resident_objects(self) -> list[str]:
        return [obj for obj, state in self.fast.items() if state is not Fast.ABSENT]
