"""Optimizers: the family-independent place where an update rule is declared.

An ``OptimizerSpec`` names the state fields it keeps per parameter (sized by
``OptimizerPolicy.state_dtypes``, one entry per field), the ops its update calls, and the
update itself, over *lists* of tensors: the lowering emits one task per parameter group
with compute key ``optim.<name>``, and its executable hands the update every tensor of
the group at once (one list for the tensors with weight decay, one for those without),
so a multi-tensor kernel updates a whole layer in one launch. Add an optimizer by adding
a spec to ``OPTIMIZERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs


@attrs.frozen
class OptimizerSpec:
    """``update(ops, params, grads, states, *, step, policy, weight_decay)`` changes the
    tensors of ``params`` and of ``states`` (field -> list, parallel to ``params``) in
    place; ``step`` counts from 1; ``policy`` is the OptimizerPolicy as a mapping;
    ``weight_decay`` is the decay for these tensors (0 for those a family exempts)."""

    name: str
    state_fields: tuple[str, ...]
    ops: tuple[str, ...]
    update: Callable[..., None]


def _adamw(
    ops: Mapping[str, Callable],
    params: Sequence[Any],
    grads: Sequence[Any],
    states: Mapping[str, Sequence[Any]],
    *,
    step: int,
    policy: Mapping[str, Any],
    weight_decay: float,
) -> None:
    ops["adamw_multi"](
        list(params),
        list(grads),
        list(states["exp_avg"]),
        list(states["exp_avg_sq"]),
        step=step,
        lr=policy["lr"],
        beta1=policy["beta1"],
        beta2=policy["beta2"],
        eps=policy["eps"],
        weight_decay=weight_decay,
    )


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", ("exp_avg", "exp_avg_sq"), ("adamw_multi",), _adamw),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}") from None
