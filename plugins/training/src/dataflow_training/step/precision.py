"""Precision policies: the dtypes of a step's weights, gradients, activations and
optimizer state, and the update that keeps them, named as one choice (``--precision``).

========== ============================================ ================== =============
name       weights, grads, activations                  AdamW state        bytes/param
========== ============================================ ================== =============
fp32       float32                                      m, v float32       4 + 4 + 8
bf16       bfloat16, the update compensated             m, v, comp. bf16   2 + 2 + 6
bf16-plain bfloat16, the update rounded                 m, v bfloat16      2 + 2 + 4
mixed      bfloat16 for compute, a float32 master       m, v, comp. fp32   2 + 2 + 12
========== ============================================ ================== =============

``bf16`` keeps a bfloat16 compensation per weight (``adamw_compensated``): each update is
applied to ``weight + compensation`` in float32 and what rounding into the bfloat16 weight
loses is kept, so a run of updates each far below a unit in the last place of the weight
still moves it (plain bfloat16 rounds every one of them away). Compensation over
stochastic rounding because it is deterministic (a resumed run repeats the losses bit for
bit, with no random stream to checkpoint or to replay inside a CUDA graph) and because the
same update with a float32 compensation is exactly ``mixed``.

``--optimizer-states int8`` (a pin, beside ``--dtype``) keeps AdamW's moments block-wise
in 8 bits (``optim.blockwise8``; the update ``adamw_int8``, plain, uncompensated): a byte
each plus a float32 scale per 256 elements, 2.03 bytes a parameter for both moments
where float32 keeps 8. Only AdamW has an 8-bit update; another optimizer refuses it.

``mixed`` is the same update with a float32 compensation: ``weight + compensation`` is
then a float32 master weight bit for bit (the compensation holds its low half; the
kernel's doc says why the sum is exact), so the update reads the float32 master and
writes it back, rounded into the bfloat16 weight the step computes with. A zero
compensation is the master equal to the weight: a fresh state needs no copy of the
weights, and the master starts as the bfloat16 rounding of the initial weights.

``auto`` is ``bf16`` on CUDA (what the throughput rows run) and ``fp32`` elsewhere.

The older pair ``--dtype fp32|bf16`` and ``--optimizer-states fp32|bf16`` stays as expert
pins (``pinned``): alone they name a plain update with those dtypes (bf16 + bf16 is
``bf16-plain``; bf16 weights with float32 moments is a policy of its own, and what a run
that used it resumes with); given beside a ``--precision`` they must agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from dataflow import DTYPE_BYTES
from dataflow_training.optim.int8_blocks import BLOCK
from dataflow_training.step.config import (
    INT8_STATES,
    STATE_CHOICES,
    STATE_DTYPES,
    DtypePolicy,
    OptimizerPolicy,
)
from dataflow_training.step.optimizers import optimizer_spec

#: the update that keeps ``--optimizer-states int8`` (``optim.adamw_int8``)
INT8_UPDATE = "adamw_int8"

#: ``--precision``'s named policies, ``auto`` aside
NAMES = ("bf16", "bf16-plain", "mixed", "fp32")
#: what ``--precision`` takes
CHOICES = ("auto", *NAMES)


@attrs.frozen
class Precision:
    """One precision policy: its name, the step's storage dtypes, the optimizer and the
    dtype of each of its state fields."""

    name: str
    dtype: DtypePolicy
    optimizer: str
    state_dtypes: dict[str, str] = attrs.field(hash=False)

    def optimizer_policy(
        self, optimizer: str = "adamw", args: Mapping[str, Any] | None = None, **fields: Any
    ) -> OptimizerPolicy:
        """The step's ``OptimizerPolicy`` for the registered ``optimizer`` with its typed
        ``args`` (``fields``: lr and the other hyperparameters). AdamW is this policy's own
        update (compensated or not); another optimizer keeps each of its state fields in
        the policy's state dtype (or the field's own), updated plainly: a policy with a
        compensation (``bf16``, ``mixed``) is a ValueError saying which would work."""
        args = dict(args or {})
        if self.optimizer == INT8_UPDATE and optimizer != "adamw":
            raise ValueError(
                f"--optimizer-states int8 keeps AdamW's two moments block-wise in 8 bits; "
                f"--optimizer {optimizer} has no 8-bit update: use --optimizer-states fp32 "
                "or bf16 with it"
            )
        if optimizer == "adamw":
            return OptimizerPolicy(
                name=self.optimizer, state_dtypes=dict(self.state_dtypes), args=args, **fields
            )
        if "compensation" in self.state_dtypes:
            raise ValueError(
                f"--optimizer {optimizer} has no compensated update, which --precision "
                f"{self.name} needs: use --precision fp32 or bf16-plain with it"
            )
        dtype = self.state_dtypes["exp_avg"]
        states = {f.name: f.dtype or dtype for f in optimizer_spec(optimizer).state}
        return OptimizerPolicy(name=optimizer, state_dtypes=states, args=args, **fields)

    @property
    def bytes_per_param(self) -> float:
        """Bytes per trainable parameter of weights + gradients + optimizer state (int8
        moments: a byte each plus a float32 scale per block, ``int8_blocks.BLOCK``; a
        whole number for every other policy)."""
        return DTYPE_BYTES[self.dtype.param] + DTYPE_BYTES[self.dtype.grad] + self.state_bytes

    @property
    def state_bytes(self) -> float:
        """Bytes per trainable parameter of optimizer state."""
        if self.optimizer == INT8_UPDATE:
            return 2 + 2 * DTYPE_BYTES["float32"] / BLOCK
        return sum(DTYPE_BYTES[d] for d in self.state_dtypes.values())

    def describe(self, optimizer: str = "adamw") -> str:
        """``precision bf16 (bf16 weights/grads/activations, bf16 AdamW moments and
        compensation; 10 B/param)``: what the plan line says; for another ``optimizer``,
        ``... fp32 lion state)`` (its state's bytes vary with its fields)."""
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        d = self.dtype
        kinds = {short.get(x, x) for x in (d.param, d.grad, d.activation)}
        compute = (
            f"{kinds.pop()} weights/grads/activations"
            if len(kinds) == 1
            else f"{short[d.param]} weights, {short[d.grad]} grads, {short[d.activation]} "
            "activations"
        )
        states = {f: short.get(x, x) for f, x in self.state_dtypes.items()}
        if optimizer != "adamw":
            return f"precision {self.name} ({compute}, {states['exp_avg']} {optimizer} state)"
        state = f"{states['exp_avg']} AdamW moments"
        if "compensation" in states:
            comp = states["compensation"]
            state += " + fp32 master" if comp == "fp32" else f" + {comp} compensation"
        return f"precision {self.name} ({compute}, {state}; {round(self.bytes_per_param, 2):g} B/param)"


def _policy(name: str, dtype: str, states: str, compensation: str | None) -> Precision:
    if states == "int8":
        return Precision(name, DtypePolicy.named(dtype), INT8_UPDATE, dict(INT8_STATES))
    fields = {"exp_avg": STATE_DTYPES[states], "exp_avg_sq": STATE_DTYPES[states]}
    if compensation is None:
        return Precision(name, DtypePolicy.named(dtype), "adamw", fields)
    fields["compensation"] = STATE_DTYPES[compensation]
    return Precision(name, DtypePolicy.named(dtype), "adamw_compensated", fields)


#: name -> (``--dtype``, ``--optimizer-states``, compensation dtype or None)
_TABLE = {
    "fp32": ("fp32", "fp32", None),
    "bf16": ("bf16", "bf16", "bf16"),
    "bf16-plain": ("bf16", "bf16", None),
    "mixed": ("bf16", "fp32", "fp32"),
}


def precision(
    name: str = "auto",
    *,
    device: str = "cpu",
    dtype: str | None = None,
    states: str | None = None,
) -> Precision:
    """The policy ``name`` (one of ``CHOICES``) for ``device``, with the expert pins
    ``dtype`` (``--dtype``) and ``states`` (``--optimizer-states``; default: ``dtype``'s).
    ``auto`` with pins is the plain update of the pinned dtypes; a named policy with a pin
    that differs from its own is a ValueError naming both options."""
    if name not in CHOICES:
        raise ValueError(f"--precision {name!r}: one of {', '.join(CHOICES)}")
    for option, value, known in (
        ("--dtype", dtype, STATE_DTYPES),
        ("--optimizer-states", states, STATE_CHOICES),
    ):
        if value is not None and value not in known:
            raise ValueError(f"{option} {value!r}: one of {', '.join(known)}")
    if name == "auto":
        if dtype is None and states is None:
            name = "bf16" if device.startswith("cuda") else "fp32"
        else:
            return pinned(dtype or "fp32", states or dtype or "fp32")
    own_dtype, own_states, _ = _TABLE[name]
    for option, value, own in (
        ("--dtype", dtype, own_dtype),
        ("--optimizer-states", states, own_states),
    ):
        if value is not None and value != own:
            raise ValueError(
                f"{option} {value} conflicts with --precision {name}, whose {option} is "
                f"{own}: give --precision alone, or --dtype/--optimizer-states alone"
            )
    return _policy(name, *_TABLE[name])


def for_optimizer(
    name: str,
    optimizer: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    states: str | None = None,
) -> Precision:
    """``precision(name, ...)`` for a run of ``optimizer``: ``auto`` without pins is
    ``bf16-plain`` on CUDA for any optimizer but AdamW (only AdamW has a compensated
    update), ``fp32`` elsewhere."""
    if name == "auto" and dtype is None and states is None and optimizer != "adamw":
        name = "bf16-plain" if device.startswith("cuda") else "fp32"
    return precision(name, device=device, dtype=dtype, states=states)


def pinned(dtype: str, states: str) -> Precision:
    """The plain update of weights in ``dtype`` and AdamW moments in ``states`` (the
    ``--dtype``/``--optimizer-states`` pair): a named policy where one is exactly that."""
    for name, row in _TABLE.items():
        if row == (dtype, states, None):
            return _policy(name, *row)
    return _policy(f"{dtype} weights, {states} moments", dtype, states, None)
