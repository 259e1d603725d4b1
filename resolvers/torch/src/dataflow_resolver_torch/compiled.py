"""The ``torch-compiled`` resolver: the eager executables, with each block kind's math
(forward, recompute, backward) compiled by ``torch.compile``.

Embedding and head stay eager: the embedding is a gather, and the head's chunked loss is
already one op. Compilation happens at a kind's first launch for its shapes, so the first
step of a run is slow; later steps reuse the compiled code. Meant for CUDA (on CPU,
inductor needs a C++ toolchain and gains little).
"""

from __future__ import annotations

from typing import Any

import torch

from dataflow.schema import Program
from dataflow_resolver_torch.training import TrainingResolver


class _CompiledMath:
    """A block kind's math with its three functions compiled once each."""

    def __init__(self, math: Any) -> None:
        self.saved_specs = math.saved_specs
        self.forward = torch.compile(math.forward)
        self.recompute = torch.compile(math.recompute)
        self.backward = torch.compile(math.backward)


class _CompiledFamily:
    """The family as the executables see it, with block kinds' math compiled."""

    def __init__(self, family: Any) -> None:
        self._family = family
        self._compiled: dict[str, _CompiledMath] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)

    def math(self, kind: str) -> Any:
        if kind in ("embed", "head"):
            return self._family.math(kind)
        if kind not in self._compiled:
            self._compiled[kind] = _CompiledMath(self._family.math(kind))
        return self._compiled[kind]


class CompiledTrainingResolver(TrainingResolver):
    name = "torch-compiled"

    def __init__(self, program: Program, *, family: Any = None, ops: Any = None) -> None:
        super().__init__(program, family=family, ops=ops)
        self.shared.family = _CompiledFamily(self.shared.family)
