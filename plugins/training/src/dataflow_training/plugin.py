"""Entry-point module of dataflow-training: adds ``dataflow verify``, ``train``, ``lower``,
``eval``, ``export``, ``predict`` and ``measure``, the ``recompute`` planner and the ``toy_moe``
family (the protocol's worked MoE example); imports torch only when the family loads."""

from __future__ import annotations

from dataflow import FamilySpec, hookimpl


@hookimpl
def dataflow_cli_commands() -> list:
    # the entry point loads at every start of `dataflow`: a hook imports what it names when called
    from dataflow_training.cli.eval_cli import eval_command
    from dataflow_training.cli.export_cli import export_command
    from dataflow_training.cli.predict_cli import measure_command, predict_command
    from dataflow_training.cli.step_cli import lower_command
    from dataflow_training.cli.train_cli import train_command
    from dataflow_training.cli.verify_cli import verify_command

    return [
        verify_command,
        train_command,
        eval_command,
        lower_command,
        export_command,
        predict_command,
        measure_command,
    ]


def _toy_moe():
    # the entry point loads at every start of `dataflow`: a hook imports what it names when called
    from dataflow_training.testing.toy_moe import ToyMoEFamily

    return ToyMoEFamily()


@hookimpl
def dataflow_planners() -> list:
    # the entry point loads at every start of `dataflow`: a hook imports what it names when called
    from dataflow_training.plan.recompute import RECOMPUTE

    return [RECOMPUTE]


@hookimpl
def dataflow_families() -> list:

    return [
        FamilySpec(
            "toy_moe",
            "a toy mixture of experts (top-2 routing as AuxTemp, expert-load Aux, experts as "
            "their own parameter group): the family protocol's worked example",
            _toy_moe,
        )
    ]


@hookimpl
def dataflow_optimizers() -> list:
    # the entry point loads at every start of `dataflow`: a hook imports what it names when called
    from dataflow_training.optim.builtins import OPTIMIZERS

    return list(OPTIMIZERS)
