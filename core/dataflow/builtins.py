"""The core's own plugin: hook implementations for what ships in the ``dataflow`` distribution.

Loaded like every third-party plugin, through the entry point ``core = dataflow.builtins`` of
the group ``dataflow`` (pyproject.toml); nothing is special-cased by name, so
``DATAFLOW_LOAD_PLUGINS`` without ``dataflow`` leaves the builtins out too.

It registers only what exists and works. Keep this module cheap to import: records point at
their code through callables that import it when called (no torch here).

Where the builtins go as they land:

- ``dataflow_planners``: PressureFit from ``dataflow.planning``, added by the planner's
  change together with its tests, as ``PlannerSpec("pressurefit", <plan function>, ...)``.
"""
