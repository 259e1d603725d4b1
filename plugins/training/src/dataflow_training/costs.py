"""Task costs from a roofline: the larger of arithmetic time and memory time.

The default rates are the ones measured on this project's H200 (device tool, KINDS.md,
2026-10-28): a bf16 8192^3 matrix product at 788 TFLOP/s and a device-to-device copy at
4.3 TB/s counting bytes read plus written. A profiling pass (later) replaces them with
per-task measurements; pass your own ``RooflineCost`` for other hardware or dtypes.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RooflineCost:
    flops_per_us: float = 788e6  # 788 TFLOP/s
    bytes_per_us: float = 4.3e6  # 4.3 TB/s

    def cost_us(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self.flops_per_us, bytes_moved / self.bytes_per_us)
