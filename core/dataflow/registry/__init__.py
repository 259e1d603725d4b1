"""Registries of what plugins add: the record types, the registry hooks, lookups and errors.

``selection`` (which distributions load) and ``report`` (what ``dataflow plugins list``
shows) hold the plugin manager's own records; ``dataflow.plugins`` builds the manager.

Pure Python: importing it never imports torch or loads a plugin.
"""

from dataflow.registry.errors import DuplicateNameError, PluginError, UnknownNameError
from dataflow.registry.kinds import KINDS_BY_NAME, REGISTRY_KINDS, RegistryKind
from dataflow.registry.records import (
    FamilySpec,
    FeedSpec,
    KernelVariant,
    OptimizerArg,
    OptimizerSpec,
    PlannerSpec,
    ResolverSpec,
    StateField,
    TrainerKindSpec,
    check_name,
)
from dataflow.registry.registry import Entry, FeedRegistry, KernelRegistry, Registry

__all__ = [
    "KINDS_BY_NAME",
    "REGISTRY_KINDS",
    "DuplicateNameError",
    "Entry",
    "FamilySpec",
    "FeedRegistry",
    "FeedSpec",
    "KernelRegistry",
    "KernelVariant",
    "OptimizerArg",
    "OptimizerSpec",
    "PlannerSpec",
    "PluginError",
    "Registry",
    "RegistryKind",
    "ResolverSpec",
    "StateField",
    "TrainerKindSpec",
    "UnknownNameError",
    "check_name",
]
