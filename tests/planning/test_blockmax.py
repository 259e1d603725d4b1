"""BlockMax agrees with a plain list under random range adds and queries."""

from __future__ import annotations

import random

from dataflow.planning.blockmax import BlockMax


def test_blockmax_matches_a_plain_list() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 300)
        ref = [rng.randint(0, 50) for _ in range(n)]
        blocks = BlockMax(ref)
        for _ in range(50):
            lo = rng.randint(0, n)
            hi = rng.randint(lo, n)
            op = rng.random()
            if op < 0.4:
                amount = rng.randint(-5, 20)
                blocks.add(lo, hi, amount)
                for t in range(lo, hi):
                    ref[t] += amount
            elif op < 0.7 and lo < hi:
                assert blocks.max(lo, hi) == max(ref[lo:hi])
            else:
                limit = rng.randint(0, 80)
                expected = next((t for t in range(hi - 1, lo - 1, -1) if ref[t] > limit), -1)
                assert blocks.last_over(lo, hi, limit) == expected
        assert blocks.to_list() == ref
