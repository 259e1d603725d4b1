"""The number of parameters a step holds and how many of them train, for the plan line.

One small function on purpose: what counts as trainable is the freeze policy's to say
(``TensorSpec.trainable`` today); the plan line only prints what this returns.
"""

from __future__ import annotations

import math

from dataflow_training.step.lowering import Lowered


def parameter_counts(step: Lowered) -> tuple[int, int]:
    """``(total, trainable)`` parameters of a lowered step (its ``layers``): every parameter tensor's elements as the model's state holds them (a vocabulary table
    padded for the kernels counts its real rows), and those of the trainable ones."""
    total = trainable = 0
    for layer in step.layers:
        for param in layer.params:
            count = math.prod(param.state_shape)
            total += count
            trainable += count if param.trainable else 0
    return total, trainable


def parameter_text(step: Lowered) -> str:
    """``parameters 124.4M (124.4M trainable)``."""
    total, trainable = parameter_counts(step)
    return f"parameters {_count(total)} ({_count(trainable)} trainable)"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)
