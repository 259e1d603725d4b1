"""The virtual backend: no data, a virtual clock. Its timeline is the simulator's.

Each task takes its ``cost_us`` (a collective task: the collective link's time for what
it reduces, ``Program.duration_us``); each transfer ``latency_us + size_bytes / bw``, at
its direction's shared rate while the other direction is busy when the links have a
duplex limit (a transfer in flight is re-timed when the other direction starts or ends,
with the simulator's ``retimed_end_us``). ``wait`` returns every operation ending at the
earliest end time, in the tie order of the execution model (task, then d2h, then h2d).
"""

from __future__ import annotations

from dataflow.engine.dispatcher import Completion, OpKind
from dataflow.schema import Program
from dataflow.sim.duplex import retimed_end_us

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}
_OTHER = {OpKind.D2H: OpKind.H2D, OpKind.H2D: OpKind.D2H}


class VirtualBackend:
    name = "virtual"
    #: it dispatches at each end, as the simulator does (``Dispatcher``'s ``run_ahead``)
    runs_in_order = False

    def __init__(self, program: Program) -> None:
        self.program = program
        self.clock_us = 0.0
        self._running: list[tuple[float, OpKind, int, float]] = []  # end, kind, ref, start
        links = program.links
        self._duplex = links.duplex_limited
        shared = links.shared_bw
        #: per direction: (its own rate, its shared rate, its latency)
        self._rates = {
            OpKind.H2D: (links.h2d.bw_bytes_per_us, shared[0], links.h2d.latency_us),
            OpKind.D2H: (links.d2h.bw_bytes_per_us, shared[1], links.d2h.latency_us),
        }
        self._drain_us: dict[OpKind, float] = {}  # per running transfer: when bytes move

    def settle(self) -> None:
        """Nothing is copied in behind a virtual step: it holds no bytes."""

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
        kind, now = _KIND[direction], self.clock_us
        size_bytes = self.program.obj(obj).size_bytes
        own_bw, shared_bw, latency_us = self._rates[kind]
        if self._duplex and _OTHER[kind] in self._drain_us:  # both busy: each at its share
            duration_us = latency_us + size_bytes / shared_bw
            self._retime(_OTHER[kind], shared=True)
        else:
            duration_us = getattr(self.program.links, direction).transfer_us(size_bytes)
        self._drain_us[kind] = now + latency_us
        self._running.append((now + duration_us, kind, serial, now))

    def wait(self) -> list[Completion]:
        end_us = min(entry[0] for entry in self._running)
        done = sorted(entry for entry in self._running if entry[0] == end_us)
        self._running = [entry for entry in self._running if entry[0] != end_us]
        self.clock_us = end_us
        for _, kind, _, _ in done:
            if kind in self._drain_us:
                del self._drain_us[kind]
                if self._duplex and _OTHER[kind] in self._drain_us:
                    self._retime(_OTHER[kind], shared=False)
        return [Completion(kind, ref, start, end) for end, kind, ref, start in done]

    def _retime(self, kind: OpKind, shared: bool) -> None:
        """The running transfer of ``kind`` changes rate now: to its shared rate when the
        other direction starts, back to its own when the other ends."""
        own_bw, shared_bw, _ = self._rates[kind]
        old_bw, new_bw = (own_bw, shared_bw) if shared else (shared_bw, own_bw)
        for position, (end_us, running, ref, start_us) in enumerate(self._running):
            if running is kind:
                end_us = retimed_end_us(end_us, self._drain_us[kind], self.clock_us, old_bw, new_bw)
                self._running[position] = (end_us, running, ref, start_us)
                return
