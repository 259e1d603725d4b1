"""Entry-point module of dataflow-training: adds ``dataflow verify``, ``train``, ``lower``,
``eval``, ``export``, ``predict``, ``measure`` and ``serve-trainer``, the ``recompute`` planner, the ``toy_moe``
family (the protocol's worked MoE example) and the reference variants of the ops a
quantized LoRA base calls (``kit.lora_base``); imports torch only when one is used."""

from __future__ import annotations

from dataflow import FamilySpec, KernelVariant, hookimpl


@hookimpl
def dataflow_cli_commands() -> list:
    # the entry point loads at every start of `dataflow`: a hook imports what it names when called
    from dataflow_training.cli.eval_cli import eval_command
    from dataflow_training.cli.export_cli import export_command
    from dataflow_training.cli.predict_cli import measure_command, predict_command
    from dataflow_training.cli.serve_cli import serve_trainer_command
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
        serve_trainer_command,
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


def _dequantize(name: str):
    def load():
        # the entry point loads at every start of `dataflow`: torch loads when the op is used
        from dataflow_training.kit import lora_base

        return getattr(lora_base, name)

    return load


@hookimpl
def dataflow_kernels() -> list:
    """``dequantize_int8(codes, scale, dtype)`` and ``dequantize_nf4(codes, absmax,
    dtype)``: a LoRA base's weight from its stored form (``kit.lora_base``), plain torch
    on every device. torchao 0.18 has no kernel for these layouts: its int8 weight-only
    linear casts the codes and multiplies as this does, and its NF4 needs its own tensor
    subclass with double-quantized scales (docs/finetuning.md)."""
    return [
        KernelVariant(
            op,
            "reference",
            _dequantize(op),
            devices=("cpu", "cuda"),
            deterministic=True,
            priority=0,
            description=what,
        )
        for op, what in (
            ("dequantize_int8", "int8 codes times their row's float32 scale"),
            ("dequantize_nf4", "NF4 values of the packed codes times their block's absmax"),
        )
    ]
