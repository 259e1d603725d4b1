"""The virtual backend: no data, a virtual clock. Its timeline is the simulator's.

Each task takes its ``cost_us`` (a collective task: the collective link's time for what
it reduces, ``Program.duration_us``); each transfer ``latency_us + size_bytes / bw``. ``wait``
returns every operation ending at the earliest end time, in the tie order of the
execution model (task, then d2h, then h2d).
"""

from __future__ import annotations

from dataflow.engine.dispatcher import Completion, OpKind
from dataflow.schema import Program

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}


class VirtualBackend:
    name = "virtual"

    def __init__(self, program: Program) -> None:
        self.program = program
        self.clock_us = 0.0
        self._running: list[tuple[float, OpKind, int, float]] = []  # end, kind, ref, start

    def now_us(self) -> float:
        return self.clock_us

    def can_alloc_fast(self, obj: str) -> bool:
        return True

    def can_start_task(self, index: int) -> bool:
        return True

    def alloc_fast(self, obj: str) -> None:
        pass

    def free_fast(self, obj: str) -> None:
        pass

    def launch_task(self, index: int) -> None:
        task = self.program.tasks[index]
        cost_us = self.program.duration_us(task)
        self._running.append((self.clock_us + cost_us, OpKind.of(task), index, self.clock_us))

    def launch_transfer(self, serial: int, obj: str, direction: str) -> None:
        link = getattr(self.program.links, direction)
        duration_us = link.transfer_us(self.program.obj(obj).size_bytes)
        self._running.append((self.clock_us + duration_us, _KIND[direction], serial, self.clock_us))

    def wait(self) -> list[Completion]:
        end_us = min(entry[0] for entry in self._running)
        done = sorted(entry for entry in self._running if entry[0] == end_us)
        self._running = [entry for entry in self._running if entry[0] != end_us]
        self.clock_us = end_us
        return [Completion(kind, ref, start, end) for end, kind, ref, start in done]
