"""The ``torch-compiled`` resolver: the training executables with each block kind's math
(forward, recompute, backward, a partial save's rederive, and the routing tasks' functions
of a block whose experts run apart: ``APART``) compiled by ``torch.compile``, the first
four together with the writes of what they return into the task's arena views
(``Strategy.run_into``): a value a fused kernel computes (a residual sum, the attention
output's head merge, a layer norm's input gradient) is stored by that kernel, where a
copy after the compiled call would read and write it again. A matrix product's result
(inductor calls cuBLAS for it into a buffer of its own) is still copied, inside the graph.

Embedding and head stay eager: the embedding is a gather, and the head's chunked loss is
already one op. Compilation happens at a kind's first launch for its shapes, so the first
step of a run is slow; later steps reuse the compiled code. Meant for CUDA (on CPU,
inductor needs a C++ toolchain and gains little).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from dataflow_training.drive import Put, Strategy, put_all
from dataflow_training.kit import Env

from dataflow_resolver_torch.training import TrainingResolver

#: torch.compile's backend where none is given (tests on the CPU set ``aot_eager``)
DEFAULT_BACKEND = "inductor"
#: the block functions the executables call through ``run_into``
FUNCTIONS = ("forward", "recompute", "backward", "rederive")
#: a block's functions when its experts run apart (``kit.block.Block``), whose tasks write
#: what they return themselves (``drive.tasks._Apart``): the routing tasks' are compiled
#: (the attention half, the router, the shared expert: the whole block's math less the
#: experts). The shards' (``experts_forward``, ``experts_backward``) stay eager: a shard's
#: window ops and grouped GEMMs are one kernel each already. Eager, the routing tasks of
#: qwen3_5_moe_cut at batch 2 took 5.1 ms forward and 15.5 ms backward a Gated DeltaNet
#: layer on the H100 (session 43's profile archive), where the whole block compiled takes
#: 8.7 and 19.8 ms at batch 4, experts included
APART = ("route_forward", "route_recompute", "route_backward")


def _own_code(run: Any, name: str) -> Any:
    """``run`` (a closure) given a code object of its own, named ``name``: dynamo keeps
    its compiled entries, and counts recompilations against its limit (8), per code
    object, and closures of one ``def`` share theirs, so every block function of every
    kind would otherwise pile onto one count and past it run uncompiled."""
    run.__code__ = run.__code__.replace(co_name=name)
    run.__name__ = run.__qualname__ = name
    return run


def _writing(function: Any, name: str) -> Any:
    """``function`` followed by the writes of its values, as one function to compile,
    under a code object of its own (``_own_code``)."""

    def run(puts: list[Put], *args: Any) -> None:
        put_all(function(*args), puts)

    return _own_code(run, name)


def _renamed(function: Any, name: str) -> Any:
    """``function`` under a code object of its own named ``name`` (``_own_code``)."""

    def run(*args: Any) -> Any:
        return function(*args)

    return _own_code(run, name)


def own_storage(value: Any) -> Any:
    """A tensor over the same memory as ``value`` with a storage object of its own (other
    values as they are).

    The engine's tensors are views of one arena: written inside a compiled graph, views
    sharing a storage make AOT autograd look for overlaps between them, and its overlap
    test compares offsets in elements, so views of different dtypes (bf16 activations
    beside a float32 logsumexp) look overlapping and it refuses them ("input mutations
    on views with different dtypes"). Views that never overlap, as the arena's do not,
    lose nothing by each having a storage of its own."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return value
    size = value.element_size()
    start = value.storage_offset() * size
    extent = 1 + sum((n - 1) * step for n, step in zip(value.shape, value.stride(), strict=True))
    storage = value.untyped_storage()[start : start + extent * size]
    alias = torch.empty(0, dtype=value.dtype, device=value.device)
    return alias.set_(storage, 0, value.shape, value.stride())


def _own_storages(args: Any) -> Any:
    """``own_storage`` through lists, tuples, dicts and an ``Env``'s Aux tensors."""
    if isinstance(args, Env):
        return attrs.evolve(args, aux=_own_storages(args.aux)) if args.aux else args
    if isinstance(args, dict):
        return {k: _own_storages(v) for k, v in args.items()}
    if isinstance(args, list | tuple):
        return type(args)(_own_storages(v) for v in args)
    return own_storage(args)


def _on_own_storages(compiled: Any) -> Any:
    """``compiled`` called with its arguments' tensors on storages of their own
    (``own_storage``: a routing task mutates its Aux in place)."""

    def run(*args: Any) -> Any:
        return compiled(*_own_storages(args))

    return run


class _CompiledMath:
    """A block kind's math with each of its functions compiled once, with its writes
    (``into``) and alone (the attribute of the function's name)."""

    def __init__(self, kind: str, math: Any, backend: str = "inductor") -> None:
        self._math = math
        self.into: dict[str, Any] = {}
        for name in FUNCTIONS:
            if hasattr(math, name):  # rederive: only a block with a partial save
                function = getattr(math, name)
                setattr(self, name, torch.compile(function, backend=backend))
                writing = _writing(function, f"{kind}_{name}_and_writes")
                self.into[name] = torch.compile(writing, backend=backend)
        for name in APART:
            if hasattr(math, name):
                compiled = torch.compile(
                    _renamed(getattr(math, name), f"{kind}_{name}"), backend=backend
                )
                setattr(self, name, _on_own_storages(compiled))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._math, name)


class CompiledStrategy(Strategy):
    """``backend``: torch.compile's (``inductor``; the CPU tests use ``aot_eager``, which
    traces the same graphs, input writes included, without generating code)."""

    name = "compiled"

    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend or DEFAULT_BACKEND

    def block_math(self, kind: str, math: Any) -> Any:
        return _CompiledMath(kind, math, self.backend)

    def run_into(self, math: Any, function: str, puts: list[Put], *args: Any) -> None:
        into = getattr(math, "into", {}).get(function)
        if into is None:
            super().run_into(math, function, puts, *args)
        else:
            into(*_own_storages((puts, *args)))


class CompiledTrainingResolver(TrainingResolver):
    name = "torch-compiled"

    def __init__(self, step: Any, *, ops: Any = None, backend: str | None = None) -> None:
        super().__init__(step, ops=ops, strategy=CompiledStrategy(backend))
