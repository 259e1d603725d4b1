"""The core's builtins are a plugin like any other: loaded through the entry point
``core = dataflow.builtins`` of distribution ``dataflow-runtime``, and held to the same checks."""

from __future__ import annotations

from dataflow.plugins import build_plugin_manager
from dataflow.testing import PlannerConformance, ResolverConformance


class TestCoreBuiltins(PlannerConformance):
    distribution = "dataflow-runtime"
    expected_names = ("pressurefit",)


def test_the_builtins_are_left_out_by_an_allowlist_without_dataflow_runtime() -> None:
    manager = build_plugin_manager(allow=["dataflow-something-else"])
    (core,) = [report for report in manager.reports() if report.distribution == "dataflow-runtime"]
    assert core.status == "disabled"
    assert manager.get_plugin("dataflow-runtime:core") is None


class TestCoreResolvers(ResolverConformance):
    distribution = "dataflow-runtime"
    expected_names = ("synthetic",)
