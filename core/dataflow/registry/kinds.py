"""The registry hooks: which hook fills which registry, with what record type and key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import click

from dataflow.registry.records import (
    FamilySpec,
    FeedSpec,
    KernelVariant,
    OptimizerSpec,
    PlannerSpec,
    ResolverSpec,
    TrainerKindSpec,
)


@attrs.frozen
class RegistryKind:
    """One registry: hook ``hook`` returns lists of ``record_type``, keyed by ``key(record)``.

    ``name`` is how reports and ``dataflow plugins list`` call the registry; ``noun`` names
    one of its entries in error messages.
    """

    name: str
    hook: str
    record_type: type
    noun: str
    key: Callable[[Any], str]


def _record_key(record: Any) -> str:
    return record.key


def _command_key(command: click.Command) -> str:
    return command.name or ""


#: Every registry hook, in the order reports list them.
REGISTRY_KINDS: tuple[RegistryKind, ...] = (
    RegistryKind("families", "dataflow_families", FamilySpec, "family", _record_key),
    RegistryKind("resolvers", "dataflow_resolvers", ResolverSpec, "resolver", _record_key),
    RegistryKind(
        "kernels", "dataflow_kernels", KernelVariant, "kernel variant (OP/NAME)", _record_key
    ),
    RegistryKind("feeds", "dataflow_feeds", FeedSpec, "feed scheme", _record_key),
    RegistryKind("planners", "dataflow_planners", PlannerSpec, "planner", _record_key),
    RegistryKind("optimizers", "dataflow_optimizers", OptimizerSpec, "optimizer", _record_key),
    RegistryKind(
        "trainer_kinds", "dataflow_trainer_kinds", TrainerKindSpec, "trainer kind", _record_key
    ),
    RegistryKind("cli_commands", "dataflow_cli_commands", click.Command, "command", _command_key),
)

KINDS_BY_NAME: dict[str, RegistryKind] = {kind.name: kind for kind in REGISTRY_KINDS}
