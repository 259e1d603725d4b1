"""The plugin passes dataflow's conformance tests for planner plugins."""

from dataflow.testing import PlannerConformance


class TestKeepAllPlanner(PlannerConformance):
    distribution = "dataflow-planner-example"
    expected_names = ("keep-all",)
