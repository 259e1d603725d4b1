"""The shared link: re-timing a transfer in flight when its rate changes.

A transfer of ``size_bytes`` starts at ``start_us``, spends its link's ``latency_us``
(moving nothing), then moves its bytes at the rate of the moment: its direction's own
``bw_bytes_per_us`` while the other direction is idle, its share of
``Links.duplex_bytes_per_us`` (``Links.shared_bw``) while the other direction is busy.
The rate changes only when the other direction starts or ends a transfer; at that instant
the bytes still to move are ``(end_us - max(now_us, drain_us)) * old_bw`` and move at
``new_bw`` from then on. The simulator and the virtual backend both call
``retimed_end_us``, so the two compute the same floats.
"""

from __future__ import annotations


def retimed_end_us(
    end_us: float, drain_us: float, now_us: float, old_bw: float, new_bw: float
) -> float:
    """The new end of a transfer that moves bytes from ``drain_us`` (its start plus its
    latency) and would end at ``end_us`` at ``old_bw``, when its rate becomes ``new_bw``
    at ``now_us``."""
    base_us = drain_us if drain_us > now_us else now_us
    return base_us + (end_us - base_us) * old_bw / new_bw
