"""The conformance bases pass good plugins and fail bad ones for the right reason.

Fake distributions are written once for the module, then one pytest run in a fresh
interpreter collects a test module whose classes subclass the bases, as plugin packages'
own tests do; each test below checks the outcomes of one class. (A fresh interpreter, not
pytester's in-process run: that drops the modules each nested session imported, and a
later session crashes the interpreter while importing them again.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from dataflow.testing import write_distribution

GOOD_PLANNER = """
from dataflow import hookimpl
from dataflow.registry import PlannerSpec
from dataflow.testing import largest_footprint_bytes


def plan(program, budget_bytes, **options):
    if budget_bytes < largest_footprint_bytes(program):
        raise ValueError(f"budget {budget_bytes} is below one task's footprint")
    return program.bare().with_budget(budget_bytes)


@hookimpl
def dataflow_planners():
    return [PlannerSpec("fits", plan, "returns the bare chain")]
"""

BAD_PLANNER = """
from dataflow import hookimpl
from dataflow.registry import PlannerSpec


def plan(program, budget_bytes):
    return None  # not a Program, and never fails


@hookimpl
def dataflow_planners():
    return [PlannerSpec("sloppy", plan)]


def dataflow_feeds():  # forgot @hookimpl: never called
    return []
"""

EVERY_KIND = """
from dataflow import hookimpl
from dataflow.registry import FamilySpec, FeedSpec, KernelVariant, ResolverSpec


@hookimpl
def dataflow_families():
    return [FamilySpec("toy", "a toy family", lambda: {"layers": 2})]


@hookimpl
def dataflow_feeds():
    return [FeedSpec("ints", lambda location, **options: iter(range(int(location))))]


@hookimpl
def dataflow_resolvers():
    return [ResolverSpec("keys", lambda program: (lambda task: task.compute_key))]


@hookimpl
def dataflow_kernels():
    return [
        KernelVariant("add", "reference", lambda: (lambda a, b: a + b)),
        KernelVariant("add", "gpu-only", lambda: 1 / 0, devices=("cuda",)),
    ]
"""

CONFORMANCE_TESTS = """
from dataflow.testing import (
    FamilyConformance,
    FeedConformance,
    KernelConformance,
    PlannerConformance,
    PluginConformance,
    ResolverConformance,
)


class TestGoodPlanner(PlannerConformance):
    distribution = "dataflow-planner-fits"
    expected_names = ("fits",)


class TestSloppyPlanner(PlannerConformance):
    distribution = "dataflow-planner-sloppy"


class TestHeavy(PluginConformance):
    distribution = "dataflow-heavy"
    forbidden_imports = ("heavy_dependency_mod",)


class TestMissing(PluginConformance):
    distribution = "dataflow-not-installed"


class TestBrokenFamily(FamilyConformance):
    distribution = "dataflow-family-broken"


class TestFamily(FamilyConformance):
    distribution = "dataflow-kinds"


class TestFeed(FeedConformance):
    distribution = "dataflow-kinds"
    feed_locations = {"ints": "3"}


class TestFeedWithoutLocations(FeedConformance):
    distribution = "dataflow-kinds"


class TestResolver(ResolverConformance):
    distribution = "dataflow-kinds"


class TestKernel(KernelConformance):
    distribution = "dataflow-kinds"
"""

#: The checks every PluginConformance subclass runs.
PLUGIN_CHECKS = {
    "test_entry_points_load",
    "test_hooks_are_known_specs",
    "test_records_are_frozen_attrs",
    "test_names_are_unique_and_valid",
    "test_names_do_not_clash_with_other_installed_plugins",
    "test_entry_point_modules_stay_light",
}


@attrs.frozen
class Run:
    outcomes: dict[str, dict[str, str]]  # class -> test -> PASSED / FAILED / SKIPPED / ERROR
    output: str


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    site = tmp_path_factory.mktemp("site-packages")
    fakes = {
        "dataflow-planner-fits": {"fits_mod": GOOD_PLANNER},
        "dataflow-planner-sloppy": {"sloppy_mod": BAD_PLANNER},
        "dataflow-heavy": {
            "heavy_plugin_mod": "import heavy_dependency_mod\n",
            "heavy_dependency_mod": "",
        },
        "dataflow-family-broken": {"broken_family_mod": "raise ImportError('no safetensors')\n"},
        "dataflow-kinds": {"kinds_mod": EVERY_KIND},
    }
    for name, modules in fakes.items():
        entry_module = next(iter(modules))
        write_distribution(site, name, entry_points={"plugin": entry_module}, modules=modules)
    tests = tmp_path_factory.mktemp("plugin-tests") / "test_plugin_conformance.py"
    tests.write_text(CONFORMANCE_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, sys.path)])}
    command = [sys.executable, "-m", "pytest", str(tests), "-v", "-p", "no:cacheprovider"]
    command += ["-p", "no:hypothesispytest", "-p", "no:benchmark"]  # not needed, slow to load
    command += ["-rs", "-W", "ignore::UserWarning", "--rootdir", str(tests.parent)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tests.parent)
    outcomes: dict[str, dict[str, str]] = {}
    for cls, test, outcome in re.findall(
        r"^\S+::(\w+)::(\w+) (PASSED|FAILED|SKIPPED|ERROR)", result.stdout, re.MULTILINE
    ):
        outcomes.setdefault(cls, {})[test] = outcome
    assert outcomes, result.stdout + result.stderr
    return Run(outcomes, result.stdout)


def _failed(run: Run, cls: str) -> set[str]:
    return {test for test, outcome in run.outcomes[cls].items() if outcome in ("FAILED", "ERROR")}


def _failure_text(run: Run, cls: str, test: str) -> str:
    """The traceback section pytest printed for one failed test."""
    sections = re.split(r"^_{3,} (?:ERROR at setup of )?(\S+) _{3,}$", run.output, flags=re.M)
    found = {sections[i]: sections[i + 1] for i in range(1, len(sections) - 1, 2)}
    return found[f"{cls}.{test}"]


def test_a_good_planner_passes_every_check(run: Run) -> None:
    assert run.outcomes["TestGoodPlanner"] == {
        test: "PASSED"
        for test in PLUGIN_CHECKS
        | {
            "test_registers_its_names",
            "test_plan_takes_a_program_and_a_budget",
            "test_plan_of_a_program_that_fits",
            "test_plan_fails_below_one_task_footprint",
        }
    }


def test_a_sloppy_planner_fails_the_checks_it_breaks(run: Run) -> None:
    assert _failed(run, "TestSloppyPlanner") == {
        "test_hooks_are_known_specs",
        "test_plan_of_a_program_that_fits",
        "test_plan_fails_below_one_task_footprint",
    }
    hooks = _failure_text(run, "TestSloppyPlanner", "test_hooks_are_known_specs")
    assert "dataflow_feeds look like hooks but are not marked with @dataflow.hookimpl" in hooks
    fits = _failure_text(run, "TestSloppyPlanner", "test_plan_of_a_program_that_fits")
    assert "planner 'sloppy' returned None" in fits
    below = _failure_text(run, "TestSloppyPlanner", "test_plan_fails_below_one_task_footprint")
    assert "DID NOT RAISE" in below


def test_a_heavy_entry_point_module_fails(run: Run) -> None:
    assert _failed(run, "TestHeavy") == {"test_entry_point_modules_stay_light"}
    text = _failure_text(run, "TestHeavy", "test_entry_point_modules_stay_light")
    assert "importing entry-point module heavy_plugin_mod imports heavy_dependency_mod" in text


def test_a_missing_distribution_says_how_to_install_it(run: Run) -> None:
    assert _failed(run, "TestMissing") == {
        "test_entry_points_load",
        "test_hooks_are_known_specs",
        "test_entry_point_modules_stay_light",
    }  # the other checks need no report, and pass vacuously
    text = _failure_text(run, "TestMissing", "test_entry_points_load")
    assert "'dataflow-not-installed' has no entry point in the group 'dataflow'" in text
    assert "pip install -e ." in text


def test_a_broken_plugin_fails_loading_and_registering(run: Run) -> None:
    failed = _failed(run, "TestBrokenFamily")
    assert {"test_entry_points_load", "test_registers_its_names"} <= failed
    text = _failure_text(run, "TestBrokenFamily", "test_entry_points_load")
    assert "broken: import failed: ImportError: no safetensors" in text
    registers = _failure_text(run, "TestBrokenFamily", "test_registers_its_names")
    assert "'dataflow-family-broken' registers no family (dataflow_families)" in registers


@pytest.mark.parametrize(
    ("cls", "checks"),
    [
        ("TestFamily", {"test_load_returns_the_family"}),
        ("TestFeed", {"test_open_takes_a_location", "test_open_returns_a_feed"}),
        ("TestResolver", {"test_build_takes_a_program", "test_build_returns_a_resolver"}),
        ("TestKernel", {"test_load_returns_a_callable"}),  # the cuda-only variant is not loaded
    ],
)
def test_each_kind_base_passes_a_conforming_plugin(run: Run, cls: str, checks: set[str]) -> None:
    expected = PLUGIN_CHECKS | {"test_registers_its_names"} | checks
    assert run.outcomes[cls] == dict.fromkeys(expected, "PASSED")


def test_a_feed_check_without_locations_skips_with_the_reason(run: Run) -> None:
    assert run.outcomes["TestFeedWithoutLocations"]["test_open_returns_a_feed"] == "SKIPPED"
    assert "set feed_locations (scheme -> a location) to open each feed" in run.output


def test_the_outcome_parser_is_not_vacuous(tmp_path: Path) -> None:
    output = "x.py::TestA::test_b PASSED\n____ TestA.test_c ____\nE   boom\n"
    assert re.findall(r"^\S+::(\w+)::(\w+) (PASSED|FAILED)", output, re.MULTILINE) == [
        ("TestA", "test_b", "PASSED")
    ]
    assert "boom" in _failure_text(Run({}, output), "TestA", "test_c")
