"""Test kit for dataflow and its plugin authors: the facade a plugin package's tests import
(docs/api.md), never a submodule.

- ``dataflow.testing.pytest_plugin`` (loaded automatically by pytest through the ``pytest11``
  entry point): the ``isolated_plugin_manager`` and ``fake_distribution`` fixtures.
- Conformance bases a plugin package's tests subclass: ``PluginConformance`` and, per kind,
  ``FamilyConformance``, ``ResolverConformance``, ``KernelConformance``, ``FeedConformance``,
  ``PlannerConformance``. They are pytest test classes: they need pytest, and are imported
  (with it) only when first named.
- ``tiny_chain()`` and the budget helpers: small programs to test plugins on;
  ``training_chain`` and ``stream_all`` build training-shaped chains (the demo's),
  ``tiny_training()`` a small training-shaped one with links.
- ``invoke``, ``assert_one_line_error``: run ``dataflow`` in-process and check a failure
  is one clean line (``USAGE_EXIT``, ``FAILURE_EXIT``).
- ``heavy_imports(module)``: what of torch and triton an entry-point module imports.
- ``import_cycles``: the module finding the import circles of a package's source, every
  import counted (``import_cycles.import_cycles``; the core's own test holds the core to
  none).
- ``trace_event_problems``: the faults of a Perfetto/Chrome trace-event document.
- ``core_plugin``: the core's own hook implementations (PressureFit), to register into an
  isolated plugin manager beside the plugins under test.

Importing it imports neither torch nor pytest: all but the first few names load when
first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from dataflow._lazy import exported, lazy_exports
from dataflow.testing.distributions import write_distribution
from dataflow.testing.light_imports import heavy_imports
from dataflow.testing.programs import (
    keep_all_bytes,
    largest_footprint_bytes,
    task_footprint_bytes,
    tiny_chain,
)

#: Names from ``dataflow.testing.conformance``, which imports pytest.
_CONFORMANCE = (
    "FamilyConformance",
    "FeedConformance",
    "KernelConformance",
    "PlannerConformance",
    "PluginConformance",
    "RegistryConformance",
    "ResolverConformance",
)

#: The other names loaded when first used, by their home module.
_HOMES = {
    "dataflow.testing.cli": ("invoke", "assert_one_line_error", "USAGE_EXIT", "FAILURE_EXIT"),
    "dataflow.testing.chains": ("training_chain", "stream_all"),
    "dataflow.testing.shapes": ("tiny_training",),
    "dataflow.testing.trace_events": ("trace_event_problems",),
}

#: Modules re-exported whole: name -> module.
_MODULES = {
    "import_cycles": "dataflow.testing.import_cycles",
    "core_plugin": "dataflow.builtins",
}

__all__ = [
    *_CONFORMANCE,
    "heavy_imports",
    "keep_all_bytes",
    "largest_footprint_bytes",
    "task_footprint_bytes",
    "tiny_chain",
    "write_distribution",
    *exported(_HOMES),
    *_MODULES,
]

_lazy_getattr, __dir__ = lazy_exports(__name__, _HOMES)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name not in _CONFORMANCE:
        return _lazy_getattr(name)
    try:
        from dataflow.testing import conformance
    except ModuleNotFoundError as exc:
        if exc.name != "pytest":
            raise
        raise ImportError(
            f"dataflow.testing.{name} is a pytest test class and needs pytest: "
            "pip install 'dataflow[test]'"
        ) from exc
    return getattr(conformance, name)
