"""The builtin optimizer specs, as ``dataflow_optimizers`` registers them. Pure Python:
each update imports its torch code on its first call (the entry point stays light)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dataflow import OptimizerArg, OptimizerSpec, StateField


def _lazy(module: str, name: str) -> Callable[..., None]:
    """An update that imports ``dataflow_training.optim.<module>.<name>`` when called."""

    def update(*args: Any, **kwargs: Any) -> None:
        function = getattr(importlib.import_module(f"dataflow_training.optim.{module}"), name)
        function(*args, **kwargs)

    update.__qualname__ = update.__name__ = name
    return update


def _shape(module: str, name: str) -> Callable[[tuple[int, ...], str], tuple[int, ...]]:
    def shape(param_shape: tuple[int, ...], role: str) -> tuple[int, ...]:
        return getattr(importlib.import_module(f"dataflow_training.optim.{module}"), name)(
            param_shape, role
        )

    shape.__qualname__ = shape.__name__ = name
    return shape


def _adam_update(op: str, fields: tuple[str, ...]) -> Callable[..., None]:
    """An update that calls the list op ``op`` once: ``(params, grads, *fields' lists,
    step, lr, beta1, beta2, eps, weight_decay)``."""

    def update(ops, params, grads, states, *, step, policy, weight_decay, roles=()) -> None:
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


_EPS = OptimizerArg("eps", "float", 1e-8, "added to the second moment's root")
_ADAM_ARGS = (
    OptimizerArg("beta1", "float", 0.9, "the first moment's decay"),
    OptimizerArg("beta2", "float", 0.95, "the second moment's decay"),
    _EPS,
)
_MOMENTS = (StateField("exp_avg"), StateField("exp_avg_sq"))

ADAMW = OptimizerSpec(
    "adamw",
    "AdamW (decoupled weight decay), one multi-tensor kernel a group (adamw_multi)",
    _MOMENTS,
    _adam_update("adamw_multi", ("exp_avg", "exp_avg_sq")),
    ops=("adamw_multi",),
    arguments=_ADAM_ARGS,
    elementwise=True,
)
#: ``adamw_compensated`` updates ``weight + compensation`` and rounds the result back into
#: the two (``adamw_compensated_multi``): with a bfloat16 compensation the update's
#: rounding is compensated Kahan-style (``--precision bf16``), with a float32 one the pair
#: is a float32 master weight bit for bit (``--precision mixed``; ``step.precision``).
ADAMW_COMPENSATED = OptimizerSpec(
    "adamw_compensated",
    "AdamW on weight + compensation, rounded back into both (--precision bf16 and mixed)",
    (*_MOMENTS, StateField("compensation")),
    _adam_update("adamw_compensated_multi", ("exp_avg", "exp_avg_sq", "compensation")),
    ops=("adamw_compensated_multi",),
    arguments=_ADAM_ARGS,
    elementwise=True,
)
#: ``adamw_int8`` keeps AdamW's moments block-wise in 8 bits (``--optimizer-states int8``;
#: ``optim.blockwise8``): int8 codes for the first, uint8 for the second, each with a float32
#: scale per block of 256 elements; the update runs ``adamw_multi`` on float32 copies.
#: Its state is a list per tensor (codes and scales of different lengths), not a flat span.
ADAMW_INT8 = OptimizerSpec(
    "adamw_int8",
    "AdamW with block-wise 8-bit moments (--optimizer-states int8; 2.03 B/param of state)",
    (
        StateField("exp_avg", dtype="int8"),
        StateField("exp_avg_sq", dtype="uint8"),
        StateField("exp_avg_scale", _shape("int8_blocks", "scale_shape"), "float32"),
        StateField("exp_avg_sq_scale", _shape("int8_blocks", "scale_shape"), "float32"),
    ),
    _lazy("adamw_int8", "adamw_int8_update"),
    ops=("adamw_multi",),
    arguments=_ADAM_ARGS,
)
LION = OptimizerSpec(
    "lion",
    "Lion (sign of interpolated momentum; one state, lr 3-10x below AdamW's)",
    (StateField("exp_avg"),),
    _lazy("lion", "lion_update"),
    arguments=(
        OptimizerArg("beta1", "float", 0.9, "interpolation of momentum and gradient"),
        OptimizerArg("beta2", "float", 0.99, "the momentum's decay"),
    ),
    elementwise=True,
)
MUON = OptimizerSpec(
    "muon",
    "Muon (Newton-Schulz orthogonalized momentum) for blocks' 2-D weights, AdamW for the rest",
    (StateField("momentum"), StateField("exp_avg_sq", _shape("muon", "second_moment_shape"))),
    _lazy("muon", "muon_update"),
    arguments=(
        OptimizerArg("momentum", "float", 0.95, "Muon's momentum"),
        OptimizerArg("nesterov", "bool", True, "Nesterov momentum for Muon"),
        OptimizerArg("ns_steps", "int", 5, "Newton-Schulz iterations"),
        OptimizerArg("adam_beta1", "float", 0.9, "AdamW's beta1 for the other tensors"),
        OptimizerArg("adam_beta2", "float", 0.95, "AdamW's beta2 for the other tensors"),
        _EPS,
    ),
)
ADAFACTOR = OptimizerSpec(
    "adafactor",
    "Adafactor (factored second moments, relative step size, no momentum)",
    (
        StateField("row", _shape("adafactor", "row_shape")),
        StateField("col", _shape("adafactor", "col_shape")),
        StateField("variance", _shape("adafactor", "full_shape")),
    ),
    _lazy("adafactor", "adafactor_update"),
    arguments=(
        OptimizerArg("beta2_decay", "float", -0.8, "beta2_t = 1 - t ** beta2_decay"),
        OptimizerArg("eps1", "float", 1.1920929e-07, "floor of the second moment's root"),
        OptimizerArg("eps2", "float", 1e-3, "floor of a weight's RMS in the step size"),
        OptimizerArg("clip_threshold", "float", 1.0, "largest RMS of an update"),
    ),
)

#: every builtin, as the training plugin's ``dataflow_optimizers`` returns them
OPTIMIZERS = (ADAMW, ADAMW_COMPENSATED, ADAMW_INT8, LION, MUON, ADAFACTOR)
