"""A list of ints with range add and range max in O(sqrt n): blocks with a lazy add each.

The prefetch placement asks, for every prefetch, whether a window of tasks has room and
adds the prefetch's bytes to it; windows can span most of the chain (an embedding used at
the start and at the end), so doing it element by element is quadratic.
"""

from __future__ import annotations

#: Elements per block.
BLOCK = 16


class BlockMax:
    """``values[t]`` with ``add(lo, hi, v)``, ``max(lo, hi)`` and ``last_over(lo, hi, x)``
    over half-open ranges ``[lo, hi)``."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.lazy = [0] * (len(values) // BLOCK + 1)
        self.top = [
            max(self.values[b : b + BLOCK], default=-(2**62))
            for b in range(0, len(values) + 1, BLOCK)
        ][: len(self.lazy)]
        while len(self.top) < len(self.lazy):
            self.top.append(-(2**62))

    def _refresh(self, block: int, lo: int, hi: int, amount: int) -> None:
        """Block ``block``'s max after ``amount`` was added to ``values[lo:hi]`` (within
        it): raising part of a block raises its max to at most that part's new max."""
        if amount >= 0:
            self.top[block] = max(self.top[block], max(self.values[lo:hi]) + self.lazy[block])
            return
        low = block * BLOCK
        self.top[block] = max(self.values[low : low + BLOCK], default=-(2**62)) + self.lazy[block]

    def add(self, lo: int, hi: int, amount: int) -> None:
        if lo >= hi:
            return
        values = self.values
        first, last = lo // BLOCK, (hi - 1) // BLOCK
        if first == last:
            values[lo:hi] = [value + amount for value in values[lo:hi]]
            self._refresh(first, lo, hi, amount)
            return
        edge = (first + 1) * BLOCK
        values[lo:edge] = [value + amount for value in values[lo:edge]]
        self._refresh(first, lo, edge, amount)
        if last > first + 1:
            lazy, top = self.lazy, self.top
            lazy[first + 1 : last] = [value + amount for value in lazy[first + 1 : last]]
            top[first + 1 : last] = [value + amount for value in top[first + 1 : last]]
        edge = last * BLOCK
        values[edge:hi] = [value + amount for value in values[edge:hi]]
        self._refresh(last, edge, hi, amount)

    def get(self, t: int) -> int:
        return self.values[t] + self.lazy[t // BLOCK]

    def max(self, lo: int, hi: int) -> int:
        if lo >= hi:
            return -(2**62)
        first, last = lo // BLOCK, (hi - 1) // BLOCK
        if first == last:
            return max(self.values[lo:hi]) + self.lazy[first]
        best = max(self.values[lo : (first + 1) * BLOCK]) + self.lazy[first]
        if last > first + 1:
            best = max(best, max(self.top[first + 1 : last]))
        return max(best, max(self.values[last * BLOCK : hi]) + self.lazy[last])

    def last_over(self, lo: int, hi: int, limit: int) -> int:
        """The largest ``t`` in ``[lo, hi)`` with ``values[t] > limit``; -1 when none."""
        values, lazy, top = self.values, self.lazy, self.top
        t = hi - 1
        while t >= lo:
            block = t // BLOCK
            low = max(lo, block * BLOCK)
            if top[block] > limit:
                above = limit - lazy[block]
                if max(values[low : t + 1]) > above:
                    return _last_above(values, low, t + 1, above)
            t = low - 1
        return -1

    def to_list(self) -> list[int]:
        return [value + self.lazy[t // BLOCK] for t, value in enumerate(self.values)]


def _last_above(values: list[int], lo: int, hi: int, limit: int) -> int:
    """The largest ``t`` in ``[lo, hi)`` with ``values[t] > limit``, which exists: halve
    the range by the max of its upper half (slices, not one element at a time)."""
    while hi - lo > 8:
        middle = (lo + hi) // 2
        if max(values[middle:hi]) > limit:
            lo = middle
        else:
            hi = middle
    return next(t for t in range(hi - 1, lo - 1, -1) if values[t] > limit)
