"""Task costs from a roofline: the largest of arithmetic time, memory time and launch time,
plus the engine's per-task dispatch gap.

``RooflineCost()`` holds the rates measured on this project's H200 (a bf16 8192^3 matrix
product at 788 TFLOP/s, a device-to-device copy at 4.3 TB/s counting bytes read plus
written: ``data/hardware.toml`` cites each) with no launch or dispatch time, which is what
the lowering prices with when it is given nothing else. A hardware table entry gives the
whole model for one device and dtype (``dataflow_training.plan.hardware``); the profiling pass
replaces the model with per-task measurements (``dataflow_training.plan.profile``).
"""

from __future__ import annotations

import attrs

#: Bumped whenever the roofline's formula changes: profile caches and reports record it.
COST_MODEL_VERSION = 2


@attrs.frozen
class RooflineCost:
    """``flops_per_us``: the compute rate of the task's dtype; ``bytes_per_us``: device
    memory bandwidth; ``launch_us``: host time to launch one kernel (a task that launches
    many small kernels is bound by it); ``dispatch_us``: the engine's gap between one
    task's end and the next one's start, added to every task."""

    flops_per_us: float = 788e6  # 788 TFLOP/s
    bytes_per_us: float = 4.3e6  # 4.3 TB/s
    launch_us: float = 0.0
    dispatch_us: float = 0.0

    def cost_us(self, flops: float, bytes_moved: float, kernels: int = 1) -> float:
        return self.dispatch_us + max(
            flops / self.flops_per_us, bytes_moved / self.bytes_per_us, kernels * self.launch_us
        )
