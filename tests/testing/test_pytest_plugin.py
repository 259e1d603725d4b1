"""The dataflow pytest plugin's fixtures: isolated managers and fake distributions."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from dataflow import hookimpl, plugins
from dataflow.registry import PlannerSpec

pytest_plugins = ["pytester"]


class _Planner:
    @hookimpl
    def dataflow_planners(self):
        return [PlannerSpec("only", lambda program, budget_bytes, **options: program)]


def test_the_plugin_is_loaded_through_its_entry_point(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("dataflow")


def test_an_isolated_manager_holds_only_its_plugins(isolated_plugin_manager) -> None:
    manager = isolated_plugin_manager(_Planner())
    assert [report.distribution for report in manager.reports()] == [f"{__name__}._Planner"]
    assert manager.planners().names() == ["only"]
    assert plugins.get_plugin_manager() is manager  # the default while the test runs


def test_the_previous_default_comes_back(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from dataflow import plugins

        def test_inside(isolated_plugin_manager):
            before = plugins.get_plugin_manager()
            isolated_plugin_manager()
            isolated_plugin_manager()
            assert plugins.get_plugin_manager() is not before
            plugins.restore_check = before

        def test_after():
            assert plugins.get_plugin_manager() is plugins.restore_check
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark"
    )
    result.assert_outcomes(passed=2)


def test_a_fake_distribution_is_installed_for_the_test_only(fake_distribution) -> None:
    dist_info = fake_distribution(
        "dataflow-fake",
        entry_points={"fake": "dataflow_fake_mod"},
        modules={"dataflow_fake_mod": "VALUE = 3\n"},
        version="0.7",
    )
    assert dist_info.name == "dataflow_fake-0.7.dist-info"
    assert metadata.version("dataflow-fake") == "0.7"
    (entry_point,) = metadata.entry_points(group="dataflow", name="fake")
    assert entry_point.load().VALUE == 3
    assert "dataflow_fake_mod" in sys.modules


def test_the_fake_distribution_is_gone_afterwards() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("dataflow-fake")
    assert "dataflow_fake_mod" not in sys.modules
