"""The ``torch-compiled`` resolver: the training executables with each block kind's math
(forward, recompute, backward, and a partial save's rederive) compiled by ``torch.compile``.

Embedding and head stay eager: the embedding is a gather, and the head's chunked loss is
already one op. Compilation happens at a kind's first launch for its shapes, so the first
step of a run is slow; later steps reuse the compiled code. Meant for CUDA (on CPU,
inductor needs a C++ toolchain and gains little).
"""

from __future__ import annotations

from typing import Any

import torch
from dataflow_training.tasks import Strategy

from dataflow.schema import Program
from dataflow_resolver_torch.training import TrainingResolver


class _CompiledMath:
    """A block kind's math with each of its functions compiled once."""

    def __init__(self, math: Any) -> None:
        self._math = math
        self.forward = torch.compile(math.forward)
        self.recompute = torch.compile(math.recompute)
        self.backward = torch.compile(math.backward)
        if hasattr(math, "rederive"):  # the rest of a partial save
            self.rederive = torch.compile(math.rederive)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._math, name)


class CompiledStrategy(Strategy):
    name = "compiled"

    def block_math(self, kind: str, math: Any) -> Any:
        return _CompiledMath(math)


class CompiledTrainingResolver(TrainingResolver):
    name = "torch-compiled"

    def __init__(self, program: Program, *, family: Any = None, ops: Any = None) -> None:
        super().__init__(program, family=family, ops=ops, strategy=CompiledStrategy())
