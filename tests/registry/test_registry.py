"""Registry: sorted by name, duplicates name both distributions, misses list known names."""

from __future__ import annotations

import pytest

from dataflow.hookspecs import hookspec
from dataflow.plugins import hook_names
from dataflow.registry import (
    KINDS_BY_NAME,
    REGISTRY_KINDS,
    DuplicateNameError,
    FeedRegistry,
    FeedSpec,
    PlannerSpec,
    Registry,
    UnknownNameError,
)

PLANNERS = KINDS_BY_NAME["planners"]


def _plan(program, budget_bytes, **options):
    return program


def test_every_registry_kind_is_a_hook_spec() -> None:
    assert {kind.hook for kind in REGISTRY_KINDS} <= set(hook_names())
    assert [kind.name for kind in REGISTRY_KINDS] == [
        "families",
        "resolvers",
        "kernels",
        "feeds",
        "planners",
        "optimizers",
        "trainer_kinds",
        "cli_commands",
    ]
    assert hookspec.project_name == "dataflow"


def test_entries_are_sorted_by_name_and_attributed() -> None:
    registry = Registry.build(
        PLANNERS,
        [("dist-b", PlannerSpec("zeta", _plan)), ("dist-a", PlannerSpec("alpha", _plan))],
    )
    assert registry.names() == ["alpha", "zeta"]
    assert [spec.name for spec in registry] == ["alpha", "zeta"]
    assert registry.distribution_of("zeta") == "dist-b"
    assert "alpha" in registry and "beta" not in registry and len(registry) == 2
    assert repr(registry) == "<Registry planners: alpha, zeta>"


def test_a_duplicate_names_both_distributions() -> None:
    with pytest.raises(DuplicateNameError) as failure:
        Registry.build(
            PLANNERS,
            [("dist-a", PlannerSpec("same", _plan)), ("dist-b", PlannerSpec("same", _plan))],
        )
    assert failure.value.distributions == ("dist-a", "dist-b")
    assert str(failure.value).startswith(
        "planner name 'same' is registered by distribution 'dist-a' and by distribution 'dist-b'"
    )


def test_a_miss_lists_the_known_names() -> None:
    registry = Registry.build(PLANNERS, [("d", PlannerSpec("keep-all", _plan))])
    with pytest.raises(UnknownNameError, match="no planner named 'pf'; known: keep-all. Run"):
        registry.get("pf")
    with pytest.raises(UnknownNameError, match="known: none"):
        Registry.build(PLANNERS, []).get("pf")
    with pytest.raises(UnknownNameError):
        registry.distribution_of("pf")


def test_feed_specs_split_at_the_first_colon() -> None:
    registry = FeedRegistry.build(
        KINDS_BY_NAME["feeds"],
        [("d", FeedSpec("text", lambda location, **options: (location, options)))],
    )
    assert registry.open("text:C:/corpus.txt", seq_len=8) == ("C:/corpus.txt", {"seq_len": 8})
