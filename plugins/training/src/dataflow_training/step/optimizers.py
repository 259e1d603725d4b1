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


def _list_update(op: str, fields: tuple[str, ...]) -> Callable[..., None]:
    """An ``OptimizerSpec.update`` that calls the list op ``op`` once: ``(params, grads,
    *state fields in the order of fields, step=..., lr, beta1, beta2, eps, weight_decay)``
    from the policy."""

    def update(
        ops: Mapping[str, Callable],
        params: Sequence[Any],
        grads: Sequence[Any],
        states: Mapping[str, Sequence[Any]],
        *,
        step: int,
        policy: Mapping[str, Any],
        weight_decay: float,
    ) -> None:
        ops[op](
            list(params),
            list(grads),
            *(list(states[field]) for field in fields),
            step=step,
            lr=policy["lr"],
            beta1=policy["beta1"],
            beta2=policy["beta2"],
            eps=policy["eps"],
            weight_decay=weight_decay,
        )

    return update


def _adam_spec(name: str, op: str, fields: tuple[str, ...]) -> OptimizerSpec:
    return OptimizerSpec(name, fields, (op,), _list_update(op, fields))


#: ``adamw_compensated`` updates ``weight + compensation`` and rounds the result back into
#: the two (``adamw_compensated_multi``): with a bfloat16 compensation the update's
#: rounding is compensated Kahan-style (``--precision bf16``), with a float32 one the pair
#: is a float32 master weight bit for bit (``--precision mixed``; ``step.precision``).
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": _adam_spec("adamw", "adamw_multi", ("exp_avg", "exp_avg_sq")),
    "adamw_compensated": _adam_spec(
        "adamw_compensated", "adamw_compensated_multi", ("exp_avg", "exp_avg_sq", "compensation")
    ),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}") from None
