"""The executables, the driver of a compiled step and its components (imports step, kit, plan).

This package's ``__init__`` is the facade for resolver authors (docs/api.md): the
executables of a lowered step and the strategy hook a resolver overrides to run the
family's math its own way. Light: each name is imported from its module when first used.
"""

from dataflow import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    "dataflow_training.drive.tasks": ("TrainingTasks", "Strategy", "Put", "put_all"),
}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
