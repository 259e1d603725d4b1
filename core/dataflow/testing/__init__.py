"""Test kit for dataflow and its plugin authors.

- ``dataflow.testing.pytest_plugin`` (loaded automatically by pytest through the ``pytest11``
  entry point): the ``isolated_plugin_manager`` and ``fake_distribution`` fixtures.
- Conformance bases a plugin package's tests subclass: ``PluginConformance`` and, per kind,
  ``FamilyConformance``, ``ResolverConformance``, ``KernelConformance``, ``FeedConformance``,
  ``PlannerConformance``. They are pytest test classes: they need pytest, and are imported
  (with it) only when first named.
- ``tiny_chain()`` and the budget helpers: small programs to test plugins on;
  ``dataflow.testing.chains`` builds training-shaped chains (the demo's).
- ``heavy_imports(module)``: what of torch and triton an entry-point module imports.
- ``dataflow.testing.import_cycles``: the import circles of a package's source, every
  import counted (``import_cycles``; the core's own test holds the core to none).

Importing it imports neither torch nor pytest.
"""

from __future__ import annotations

from typing import Any

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

__all__ = [
    *_CONFORMANCE,
    "heavy_imports",
    "keep_all_bytes",
    "largest_footprint_bytes",
    "task_footprint_bytes",
    "tiny_chain",
    "write_distribution",
]


def __getattr__(name: str) -> Any:
    if name not in _CONFORMANCE:
        raise AttributeError(f"module 'dataflow.testing' has no attribute {name!r}")
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
