"""The core's own plugin: hook implementations for what ships in the ``dataflow`` distribution.

Loaded like every third-party plugin, through the entry point ``core = dataflow.builtins`` of
the group ``dataflow`` (pyproject.toml); nothing is special-cased by name, so
``DATAFLOW_LOAD_PLUGINS`` without ``dataflow`` leaves the builtins out too.

It registers only what exists and works. Keep this module cheap to import: records point at
their code through callables that import it when called (no torch here).

Registered here:

- ``dataflow_planners``: PressureFit (``dataflow.planning.PRESSUREFIT``), as ``pressurefit``
  (imported when the hook is called, not when this module is).
"""

from __future__ import annotations

from dataflow import hookimpl
from dataflow.registry import PlannerSpec


@hookimpl
def dataflow_planners() -> list[PlannerSpec]:
    from dataflow.planning import PRESSUREFIT

    return [PRESSUREFIT]
