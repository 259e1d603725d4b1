"""The entry-point module: registers the ``sgd`` optimizer's record. Light: the update's
torch code is imported by ``sgd.py`` when the first update runs."""

from __future__ import annotations

from dataflow import OptimizerArg, OptimizerSpec, StateField, hookimpl


def _update(*args, **kwargs) -> None:
    # imported when the first update runs: listing plugins imports no torch
    from dataflow_optimizer_sgd.sgd import sgd_update

    sgd_update(*args, **kwargs)


SGD = OptimizerSpec(
    "sgd",
    "SGD with momentum (one state tensor a parameter; Nesterov optional)",
    (StateField("momentum"),),  # the parameter's shape, in the run's state dtype
    _update,
    arguments=(
        OptimizerArg("momentum", "float", 0.9, "the momentum's decay (0: plain SGD)"),
        OptimizerArg("dampening", "float", 0.0, "how much of each gradient is left out"),
        OptimizerArg("nesterov", "bool", False, "Nesterov momentum"),
    ),
    elementwise=True,  # every element alike: the task may hand a whole group as one tensor
)


@hookimpl
def dataflow_optimizers() -> list[OptimizerSpec]:
    return [SGD]
