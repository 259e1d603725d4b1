"""Conformance tests that plugin packages subclass (in the manner of pandas' extension tests).

A plugin package's tests say which distribution to check, and inherit the tests::

    from dataflow.testing import PlannerConformance

    class TestKeepAll(PlannerConformance):
        distribution = "dataflow-planner-example"
        expected_names = ("keep-all",)

``PluginConformance`` checks what every plugin must satisfy; ``FamilyConformance``,
``ResolverConformance``, ``KernelConformance``, ``FeedConformance`` and
``PlannerConformance`` add what can be checked of one kind of record without knowing the
plugin. The checks load only the distribution under test (``allow=[distribution]``).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import attrs
import pytest

from dataflow.plugins import (
    DataflowPluginManager,
    PluginReport,
    Status,
    get_plugin_manager,
    hook_names,
    normalize_distribution,
)
from dataflow.registry import REGISTRY_KINDS, check_name
from dataflow.schema import Program, validate
from dataflow.testing.light_imports import HEAVY_MODULES, entry_point_module, heavy_imports
from dataflow.testing.programs import keep_all_bytes, largest_footprint_bytes, tiny_chain


class PluginConformance:
    """What every plugin distribution must satisfy. Set ``distribution`` in the subclass."""

    #: The distribution under test, as its pyproject.toml's ``[project] name`` spells it.
    distribution: ClassVar[str] = ""
    #: Modules an entry-point module must not import: dataflow imports entry-point modules
    #: on every CLI call, so heavy code belongs behind the records' callables.
    forbidden_imports: ClassVar[tuple[str, ...]] = HEAVY_MODULES

    @pytest.fixture
    def plugin_manager(self) -> DataflowPluginManager:
        """A fresh manager that loads only the distribution under test."""
        if not self.distribution:
            pytest.fail(f"{type(self).__name__} must set `distribution` to the package's name")
        return get_plugin_manager(autoload=False, allow=[self.distribution])

    @pytest.fixture
    def reports(self, plugin_manager: DataflowPluginManager) -> list[PluginReport]:
        """The reports of the distribution's entry points (failing when there is none)."""
        wanted = normalize_distribution(self.distribution)
        mine = [
            report
            for report in plugin_manager.reports()
            if normalize_distribution(report.distribution) == wanted
        ]
        if not mine:
            pytest.fail(
                f"distribution {self.distribution!r} has no entry point in the group "
                "'dataflow': is it installed (pip install -e .), and does its pyproject.toml "
                "have a [project.entry-points.dataflow] table?"
            )
        return mine

    def test_entry_points_load(self, reports: list[PluginReport]) -> None:
        broken = [report.describe() for report in reports if report.status is not Status.OK]
        assert not broken, "\n".join(broken)

    def test_hooks_are_known_specs(
        self, plugin_manager: DataflowPluginManager, reports: list[PluginReport]
    ) -> None:
        known = set(hook_names())
        for report in reports:
            assert set(report.hooks) <= known, f"{report.describe()}: unknown hooks"
            plugin = plugin_manager.get_plugin(report.name)
            unmarked = [
                name
                for name in dir(plugin)
                if name.startswith("dataflow_")
                and callable(getattr(plugin, name))
                and not hasattr(getattr(plugin, name), "dataflow_impl")
            ]
            assert not unmarked, (
                f"{report.describe()}: {', '.join(unmarked)} look like hooks but are not "
                "marked with @dataflow.hookimpl, so they are never called"
            )

    def test_records_are_frozen_attrs(self, plugin_manager: DataflowPluginManager) -> None:
        for kind in REGISTRY_KINDS:
            if kind.name == "cli_commands":  # click commands, not records
                continue
            for _, record in plugin_manager.records(kind.name):
                assert attrs.has(type(record)), f"{kind.hook} returned {record!r}"
                field = attrs.fields(type(record))[0].name
                with pytest.raises(attrs.exceptions.FrozenInstanceError):
                    setattr(record, field, getattr(record, field))

    def test_names_are_unique_and_valid(self, plugin_manager: DataflowPluginManager) -> None:
        for kind in REGISTRY_KINDS:
            registry = plugin_manager.registry(kind.name)  # DuplicateNameError on a repeat
            for name in registry.names():
                check_name(kind.noun, name)

    def test_names_do_not_clash_with_other_installed_plugins(self) -> None:
        everything = get_plugin_manager(autoload=True)  # DATAFLOW_LOAD_PLUGINS still applies
        wanted = normalize_distribution(self.distribution)
        clashes = [
            str(conflict)
            for conflict in everything.conflicts()
            if wanted in map(normalize_distribution, conflict.distributions)
        ]
        assert not clashes, "\n".join(clashes)

    def test_entry_point_modules_stay_light(self, reports: list[PluginReport]) -> None:
        for report in reports:
            assert report.entry_point is not None
            module = entry_point_module(report.entry_point)
            heavy = heavy_imports(module, self.forbidden_imports)
            assert not heavy, (
                f"importing entry-point module {module} imports {', '.join(heavy)}; import "
                "them inside the records' callables instead"
            )


class RegistryConformance(PluginConformance):
    """A plugin that registers records of one kind (``kind_name``, such as ``planners``)."""

    kind_name: ClassVar[str] = ""
    #: When set, exactly the names the distribution must register in that registry.
    expected_names: ClassVar[tuple[str, ...]] = ()

    @pytest.fixture
    def registered(self, plugin_manager: DataflowPluginManager) -> list[Any]:
        """The records of ``kind_name`` that the distribution registers, by name."""
        return list(plugin_manager.registry(self.kind_name))

    def test_registers_its_names(self, registered: list[Any]) -> None:
        kind = next(kind for kind in REGISTRY_KINDS if kind.name == self.kind_name)
        names = [kind.key(record) for record in registered]
        assert names, f"{self.distribution!r} registers no {kind.noun} ({kind.hook})"
        if self.expected_names:
            assert names == sorted(self.expected_names)


def _accepts(function: Any, *args: Any) -> bool:
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        return False
    return True


class FamilyConformance(RegistryConformance):
    """A model-family plugin: each ``FamilySpec.load()`` imports and returns the family."""

    kind_name = "families"

    def test_load_returns_the_family(self, registered: list[Any]) -> None:
        for spec in registered:
            assert spec.load() is not None, f"family {spec.name!r}: load() returned None"


class ResolverConformance(RegistryConformance):
    """A resolver plugin: ``build(program)`` returns a callable Resolver."""

    kind_name = "resolvers"

    @pytest.fixture
    def program(self) -> Program:
        """A program the resolvers can be built for; override for one with your keys."""
        return tiny_chain()

    def test_build_takes_a_program(self, registered: list[Any]) -> None:
        for spec in registered:
            assert _accepts(spec.build, None), f"resolver {spec.name!r}: build(program) fails"

    def test_build_returns_a_resolver(self, registered: list[Any], program: Program) -> None:
        for spec in registered:
            resolver = spec.build(program)
            assert callable(resolver), f"resolver {spec.name!r}: {resolver!r} is not callable"


class KernelConformance(RegistryConformance):
    """A kernel plugin: variants that run on ``loadable_devices`` load to a callable."""

    kind_name = "kernels"
    #: Variants supporting one of these devices must load here (override for GPU CI).
    loadable_devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def test_load_returns_a_callable(self, registered: list[Any]) -> None:
        loadable = [v for v in registered if set(v.devices) & set(self.loadable_devices)]
        if not loadable:
            pytest.skip(f"no variant supports any of {self.loadable_devices}")
        for variant in loadable:
            kernel = variant.load()
            assert callable(kernel), f"kernel {variant.key!r}: load() returned {kernel!r}"


class FeedConformance(RegistryConformance):
    """A feed plugin: ``open(location, **options)`` for each scheme."""

    kind_name = "feeds"
    #: scheme -> a location ``open`` can open in the test environment (shipped test data).
    feed_locations: ClassVar[dict[str, str]] = {}

    def test_open_takes_a_location(self, registered: list[Any]) -> None:
        for spec in registered:
            assert _accepts(spec.open, "location"), f"feed {spec.scheme!r}: open(location) fails"

    def test_open_returns_a_feed(self, registered: list[Any]) -> None:
        if not self.feed_locations:
            pytest.skip("set feed_locations (scheme -> a location) to open each feed")
        by_scheme = {spec.scheme: spec for spec in registered}
        for scheme, location in self.feed_locations.items():
            assert scheme in by_scheme, f"feed_locations names {scheme!r}, not registered"
            assert by_scheme[scheme].open(location) is not None


class PlannerConformance(RegistryConformance):
    """A planner plugin: ``plan(program, budget_bytes, **options)`` returns a valid Program
    that keeps the chain's tasks in order, and fails on a budget below one task's needs."""

    kind_name = "planners"

    @pytest.fixture
    def program(self) -> Program:
        """A bare chain every planner can plan (all objects fit at once)."""
        return tiny_chain()

    def test_plan_takes_a_program_and_a_budget(self, registered: list[Any]) -> None:
        for spec in registered:
            assert _accepts(spec.plan, None, 1), (
                f"planner {spec.name!r}: plan(program, budget_bytes) fails"
            )

    def test_plan_of_a_program_that_fits(self, registered: list[Any], program: Program) -> None:
        task_ids = [task.id for task in program.tasks]
        for spec in registered:
            planned = spec.plan(program, keep_all_bytes(program))
            assert isinstance(planned, Program), f"planner {spec.name!r} returned {planned!r}"
            assert validate(planned) == [], f"planner {spec.name!r}: {validate(planned)}"
            planned_ids = iter(task.id for task in planned.tasks)
            assert all(task_id in planned_ids for task_id in task_ids), (
                f"planner {spec.name!r} dropped or reordered tasks of {task_ids}"
            )

    def test_plan_fails_below_one_task_footprint(
        self, registered: list[Any], program: Program
    ) -> None:
        budget_bytes = largest_footprint_bytes(program) - 1
        for spec in registered:
            with pytest.raises(Exception) as failure:  # noqa: B017  # any error, with a message
                spec.plan(program, budget_bytes)
            assert str(failure.value), f"planner {spec.name!r} failed without a message"
