"""The core's own plugin: hook implementations for what ships in the ``dataflow`` distribution.

Loaded like every third-party plugin, through the entry point ``core = dataflow.builtins`` of
the group ``dataflow`` (pyproject.toml); nothing is special-cased by name, so
``DATAFLOW_LOAD_PLUGINS`` without ``dataflow`` leaves the builtins out too.

It registers only what exists and works. Keep this module cheap to import: records point at
their code through callables that import it when called (no torch here).

Registered here:

- ``dataflow_planners``: PressureFit (``dataflow.planning.PRESSUREFIT``), as ``pressurefit``
  (imported when the hook is called, not when this module is).
- ``dataflow_resolvers``: ``synthetic`` (``dataflow.engine.backends.torch_synthetic``), which
  runs any program by its task costs without real math (``dataflow trace`` of a synthetic
  chain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataflow import hookimpl
from dataflow.registry import PlannerSpec, ResolverSpec

if TYPE_CHECKING:
    from dataflow.engine import Resolver
    from dataflow.schema import Program


@hookimpl
def dataflow_planners() -> list[PlannerSpec]:
    from dataflow.planning import PRESSUREFIT

    return [PRESSUREFIT]


def _build_synthetic(program: Program) -> Resolver:
    from dataflow.engine.backends.torch_synthetic import build

    return build(program)


@hookimpl
def dataflow_resolvers() -> list[ResolverSpec]:
    return [
        ResolverSpec(
            "synthetic",
            _build_synthetic,
            "runs any program by its task costs, no real math (fills outputs, waits cost_us)",
        )
    ]
