"""Optimizers: the family-independent place where an update rule is declared.

An ``OptimizerSpec`` names the state fields it keeps per parameter (sized by
``OptimizerPolicy.state_dtypes``, one entry per field) and the update of one parameter.
The lowering emits one task per layer with compute key ``optim.<name>``; the torch
resolver runs ``spec.update`` for every parameter of the layer. Add an optimizer by adding
a spec to ``OPTIMIZERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs


@attrs.frozen
class OptimizerSpec:
    """``update(ops, param, grad, states, *, step, policy, decay)`` changes ``param`` and
    the tensors of ``states`` (field -> tensor) in place; ``step`` counts from 1; ``policy``
    is the OptimizerPolicy as a mapping; ``decay`` says whether weight decay applies."""

    name: str
    state_fields: tuple[str, ...]
    update: Callable[..., None]


def _adamw(
    ops: Mapping[str, Callable],
    param: Any,
    grad: Any,
    states: Mapping[str, Any],
    *,
    step: int,
    policy: Mapping[str, Any],
    decay: bool,
) -> None:
    ops["adamw"](
        param,
        grad,
        states["exp_avg"],
        states["exp_avg_sq"],
        step=step,
        lr=policy["lr"],
        beta1=policy["beta1"],
        beta2=policy["beta2"],
        eps=policy["eps"],
        weight_decay=policy["weight_decay"] if decay else 0.0,
    )


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", ("exp_avg", "exp_avg_sq"), _adamw),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}") from None
