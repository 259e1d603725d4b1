"""Test kit for dataflow and its plugin authors.

- ``dataflow.testing.pytest_plugin`` (loaded automatically by pytest through the ``pytest11``
  entry point): the ``isolated_plugin_manager`` and ``fake_distribution`` fixtures.
- Conformance bases a plugin package's tests subclass: ``PluginConformance`` and, per kind,
  ``FamilyConformance``, ``ResolverConformance``, ``KernelConformance``, ``FeedConformance``,
  ``PlannerConformance``.
- ``tiny_chain()`` and the budget helpers: small programs to test plugins on.

Importing it never imports torch.
"""

from dataflow.testing.conformance import (
    FamilyConformance,
    FeedConformance,
    KernelConformance,
    PlannerConformance,
    PluginConformance,
    RegistryConformance,
    ResolverConformance,
)
from dataflow.testing.distributions import write_distribution
from dataflow.testing.programs import (
    keep_all_bytes,
    largest_footprint_bytes,
    task_footprint_bytes,
    tiny_chain,
)

__all__ = [
    "FamilyConformance",
    "FeedConformance",
    "KernelConformance",
    "PlannerConformance",
    "PluginConformance",
    "RegistryConformance",
    "ResolverConformance",
    "keep_all_bytes",
    "largest_footprint_bytes",
    "task_footprint_bytes",
    "tiny_chain",
    "write_distribution",
]
