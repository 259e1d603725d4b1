"""dataflow's training plugin: the family protocol v2 (``dataflow_training.step.family``), the
lowering, the typed step layout, the executables, verify, and the shared family kit."""

from dataflow_training.step.family import (
    BlockMath,
    EmbedMath,
    Env,
    Family,
    HeadMath,
    LayerCost,
    LayerSpec,
    ParamGroup,
    PartialSave,
    RowGradient,
    TensorSpec,
    Work,
)

__all__ = [
    "BlockMath",
    "EmbedMath",
    "Env",
    "Family",
    "HeadMath",
    "LayerCost",
    "LayerSpec",
    "ParamGroup",
    "PartialSave",
    "RowGradient",
    "TensorSpec",
    "Work",
]
