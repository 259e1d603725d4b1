"""dataflow's training plugin: the family protocol (``dataflow_training.family``)."""

from dataflow_training.family import (
    BlockMath,
    EmbedMath,
    Family,
    HeadMath,
    LayerSpec,
    TensorSpec,
)

__all__ = ["BlockMath", "EmbedMath", "Family", "HeadMath", "LayerSpec", "TensorSpec"]
