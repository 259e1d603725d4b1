"""Entry-point module: registers resolver ``torch``; imports torch only when built."""

from __future__ import annotations

from dataflow import ResolverSpec, hookimpl


def _build(step):
    """``step``: a lowered training step, or a program read from a file."""
    from dataflow_resolver_torch.training import TrainingResolver

    return TrainingResolver(step)


def _build_compiled(step):
    from dataflow_resolver_torch.compiled import CompiledTrainingResolver

    return CompiledTrainingResolver(step)


@hookimpl
def dataflow_resolvers() -> list[ResolverSpec]:
    return [
        ResolverSpec("torch", _build, "lowered training steps, eager torch, kernel registry ops"),
        ResolverSpec(
            "torch-compiled",
            _build_compiled,
            "as torch, with each block kind's math compiled by torch.compile (CUDA)",
        ),
    ]
