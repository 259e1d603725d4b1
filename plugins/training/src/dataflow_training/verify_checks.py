"""What every level of ``dataflow verify`` returns: a ``Check`` per comparison, made by
``compare`` (relative error ``||out - ref|| / ||ref||``, with the largest absolute
difference beside it), against the tolerances of ``TOLERANCES`` (per dtype policy and
level; docs/correctness_compare.md says why each)."""

from __future__ import annotations

import math
from typing import Any

import attrs

#: largest relative error accepted, per dtype policy and level
TOLERANCES = {
    "fp32": {"op": 1e-5, "task": 1e-4, "step": 1e-4},
    "bf16": {"op": 1e-2, "task": 3e-2, "step": 5e-2},
}


@attrs.frozen
class Check:
    level: str
    name: str
    max_abs: float
    rel: float
    tolerance: float
    #: also accepted: every element within this absolute distance (see step_checks)
    abs_tolerance: float | None = None

    @property
    def ok(self) -> bool:
        if self.abs_tolerance is not None and self.max_abs <= self.abs_tolerance:
            return True
        return math.isfinite(self.rel) and self.rel <= self.tolerance


def compare(level: str, name: str, out: Any, ref: Any, tolerance: float) -> Check:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        return Check(
            level,
            f"{name} (shape {tuple(out64.shape)} != {tuple(ref64.shape)})",
            math.inf,
            math.inf,
            tolerance,
        )
    diff = (out64 - ref64).norm().item()
    scale = ref64.norm().item()
    rel = diff / scale if scale > 0 else diff
    return Check(
        level, name, (out64 - ref64).abs().max().item() if out64.numel() else 0.0, rel, tolerance
    )
