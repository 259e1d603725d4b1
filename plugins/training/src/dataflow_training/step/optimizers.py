"""Optimizers: where the step finds the update rule its ``OptimizerPolicy`` names.

An optimizer is an ``OptimizerSpec`` (``dataflow.registry``) that a plugin registers
through the ``dataflow_optimizers`` hook (the builtins: ``optim.builtins``): the state
fields it keeps per parameter (each with its shape relative to the parameter, sized in the
dtypes of ``OptimizerPolicy.state_dtypes``), its typed arguments (``--optimizer-arg``) and
its update over *lists* of tensors: the lowering emits one task per parameter group with
compute key ``optim.<name>``, and its executable hands the update every tensor of the
group at once (one list for the tensors with weight decay, one for those without), so a
multi-tensor kernel updates a whole layer in one launch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from dataflow import OptimizerSpec, optimizers
from dataflow_training.optim.builtins import OPTIMIZERS

__all__ = ["OptimizerSpec", "hyperparameters", "optimizer_spec", "parse_optimizer_args"]


def optimizer_spec(name: str) -> OptimizerSpec:
    """The optimizer ``name``: the one a plugin registered, else the training plugin's
    builtin of that name (``optim.builtins``: found even where a plugin manager was built
    without this plugin, as tests build theirs); ValueError lists the known ones."""
    registry = optimizers()
    if name in registry.names():
        return registry.get(name)
    builtins = {spec.name: spec for spec in OPTIMIZERS}
    if name in builtins:
        return builtins[name]
    known = sorted({*registry.names(), *builtins})
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(known)}")


def parse_optimizer_args(name: str, pairs: Iterable[str]) -> dict[str, Any]:
    """``--optimizer-arg K=V`` texts as optimizer ``name``'s typed arguments."""
    return optimizer_spec(name).parse_args(pairs)


#: OptimizerPolicy's own hyperparameters that a spec may also declare as arguments
_POLICY_FIELDS = ("beta1", "beta2", "eps")


def hyperparameters(policy: Any, spec: OptimizerSpec) -> dict[str, Any]:
    """What ``spec.update`` gets as ``policy``: ``lr`` and ``weight_decay``, then every
    argument the spec declares: the policy's ``args`` where given, else the policy's own
    field of that name (``beta1``, ``beta2``, ``eps``) where set away from its default,
    else the spec's default."""
    values = {"lr": policy.lr, "weight_decay": policy.weight_decay, **spec.defaults()}
    defaults = {f.name: f.default for f in attrs.fields(type(policy))}
    for name in _POLICY_FIELDS:
        if name in values and getattr(policy, name) != defaults[name]:
            values[name] = getattr(policy, name)
    values.update(policy.args)
    return values
