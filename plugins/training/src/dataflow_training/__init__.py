"""dataflow's training plugin, by stage: ``step`` (what a training step is, its lowering),
``kit`` (the parts families are composed of), ``plan`` (pricing, the recompute search, the
compiled step), ``drive`` (executables, the driver and its components), ``check`` (the
correctness ladder), ``cli``; ``testing`` for tests.

This module is the facade for runtime users: compile a family preset's step, drive it,
train, verify. Family and kit authors import ``dataflow_training.kit``; resolver authors
``dataflow_training.drive``; tests ``dataflow_training.testing`` (docs/api.md). Nothing
else is public. Light (the entry point ``dataflow_training.plugin`` imports it): each name
is imported from its module when first used.
"""

from dataflow import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    "dataflow_training.plan.compiled_step": ("compile_step", "CompiledStep"),
    "dataflow_training.drive.run": ("TrainingRun", "StepStats"),
    "dataflow_training.drive.trainer": ("train",),
    "dataflow_training.drive.options": ("TrainOptions",),
    "dataflow_training.drive.phases": ("Phase", "PhaseRecipe"),
    "dataflow_training.step.freezing": ("FreezeError",),
    "dataflow_training.step.lora": ("LoraConfig", "LoraError"),
    "dataflow_training.step.config": (
        "TrainConfig",
        "DtypePolicy",
        "OptimizerPolicy",
        "optimizer_states",
    ),
    "dataflow_training.step.optimizers": ("OptimizerSpec", "optimizer_spec"),
    "dataflow_training.step.precision": ("precision", "Precision"),
    "dataflow_training.step.family": ("load_family",),
    "dataflow_training.kit.segments": ("Segments", "packed_documents"),
    "dataflow_training.step.lowering": ("lower", "Lowered"),
    "dataflow_training.step.layout": ("StepLayout",),
    "dataflow_training.drive.values": ("start_values", "read_state"),
    "dataflow_training.plan.predict": ("step_flops",),
    "dataflow_training.check.verify": (
        "verify",
        "Check",
        "TOLERANCES",
        "op_checks",
        "task_checks",
        "step_checks",
    ),
    "dataflow_training.cli.verify_cli": ("check_preset",),
    "dataflow_training.service.client": ("TrainerClient", "ServiceError"),
    "dataflow_training.service.batches": ("write_token_batch",),
}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
