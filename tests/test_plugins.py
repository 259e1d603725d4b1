"""The plugin manager: entry points, allowlist, kill switch, broken plugins, registries.

Each hook has a ``test_hook_<name>`` here (tests/test_hookspecs_docs.py checks that).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import click
import pytest

from dataflow import hookimpl, plugins
from dataflow.cli.main import plugin_commands
from dataflow.plugins import (
    DISABLE_AUTOLOAD_ENV,
    LOAD_PLUGINS_ENV,
    PluginWarning,
    Status,
    build_plugin_manager,
    get_plugin_manager,
    hook_names,
)
from dataflow.registry import (
    DuplicateNameError,
    FamilySpec,
    FeedSpec,
    KernelVariant,
    PlannerSpec,
    ResolverSpec,
    TrainerKindSpec,
    UnknownNameError,
)
from dataflow.testing import tiny_chain

EXAMPLE = "dataflow-planner-example"


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_example = pytest.mark.skipif(
    not _installed(EXAMPLE),
    reason=f"{EXAMPLE} is not installed (pip install -e examples/third_party_plugin)",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOAD_PLUGINS_ENV, raising=False)
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)


def _by_distribution(manager: plugins.DataflowPluginManager) -> dict[str, plugins.PluginReport]:
    return {report.distribution: report for report in manager.reports()}


def _plan(program, budget_bytes, **options):
    return program


def _planner_module(name: str, planner: str) -> str:
    """Source of a plugin module registering one planner called ``planner``."""
    return (
        "from dataflow import hookimpl\n"
        "from dataflow.registry import PlannerSpec\n"
        "def plan(program, budget_bytes, **options):\n"
        "    return program\n"
        "@hookimpl\n"
        "def dataflow_planners():\n"
        f"    return [PlannerSpec({planner!r}, plan, 'from {name}')]\n"
    )


# -- loading ---------------------------------------------------------------------------------
def test_importing_the_plugin_modules_loads_no_plugin_and_no_torch() -> None:
    code = (
        "import sys, dataflow, dataflow.plugins, dataflow.hookspecs, dataflow.registry, "
        "dataflow.testing\n"
        "loaded = [m for m in ('torch', 'dataflow.builtins', 'dataflow_planner_example')"
        " if m in sys.modules]\n"
        "print(loaded); sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_building_a_manager_imports_no_torch() -> None:
    code = (
        "import sys; from dataflow.plugins import get_plugin_manager\n"
        "get_plugin_manager(allow=['dataflow-runtime']).reports()\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_core_builtins_load_through_their_entry_point() -> None:
    report = _by_distribution(build_plugin_manager())["dataflow-runtime"]
    assert report.entry_point == "core = dataflow.builtins"
    assert report.status is Status.OK
    assert report.version == metadata.version("dataflow-runtime")


@needs_example
def test_an_installed_plugin_is_discovered_and_attributed() -> None:
    manager = build_plugin_manager()
    report = _by_distribution(manager)[EXAMPLE]
    assert report.status is Status.OK
    assert report.hooks == ("dataflow_planners",)
    assert report.registers == {"planners": ("keep-all",)}
    assert manager.planners().distribution_of("keep-all") == EXAMPLE


@needs_example
def test_the_allowlist_leaves_out_every_other_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "dataflow-runtime")
    manager = build_plugin_manager()
    reports = _by_distribution(manager)
    assert reports["dataflow-runtime"].status is Status.OK
    assert reports[EXAMPLE].status is Status.DISABLED
    assert reports[EXAMPLE].reason == f"not in {LOAD_PLUGINS_ENV}='dataflow-runtime'"
    assert "keep-all" not in manager.planners()
    assert EXAMPLE.replace("-", "_") + ".plugin" not in _fresh_modules(LOAD_PLUGINS_ENV)


def _fresh_modules(env_name: str, value: str = "dataflow-runtime") -> list[str]:
    """Modules a fresh interpreter has imported after building the default manager."""
    code = (
        "import sys; from dataflow.plugins import get_plugin_manager\n"
        "get_plugin_manager().reports(); print('\\n'.join(sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (LOAD_PLUGINS_ENV, DISABLE_AUTOLOAD_ENV)}
    env[env_name] = value
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return result.stdout.split()


@needs_example
def test_the_allowlist_compares_normalized_distribution_names() -> None:
    manager = build_plugin_manager(allow=["Dataflow_Planner.Example"])
    assert manager.planners().names() == ["keep-all"]
    assert _by_distribution(manager)["dataflow-runtime"].status is Status.DISABLED


def test_an_allowlist_set_but_empty_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "")
    reports = build_plugin_manager().reports()
    assert reports and {report.status for report in reports} == {Status.DISABLED}


def test_an_allowlist_name_that_matches_nothing_is_kept_for_the_report() -> None:
    manager = build_plugin_manager(allow=["dataflow-runtime", "dataflow-no-such-plugin"])
    assert manager.unmatched_allow == ("dataflow-no-such-plugin",)


@needs_example
def test_the_kill_switch_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    manager = build_plugin_manager()
    reports = _by_distribution(manager)
    assert {report.status for report in reports.values()} == {Status.DISABLED}
    assert reports[EXAMPLE].reason == f"{DISABLE_AUTOLOAD_ENV} is set"
    assert len(manager.planners()) == 0
    assert "dataflow_planner_example.plugin" not in _fresh_modules(DISABLE_AUTOLOAD_ENV, "1")


@needs_example
def test_the_kill_switch_still_loads_what_the_allowlist_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(LOAD_PLUGINS_ENV, EXAMPLE)
    reports = _by_distribution(build_plugin_manager())
    assert reports[EXAMPLE].status is Status.OK
    assert reports["dataflow-runtime"].status is Status.DISABLED


def test_explicit_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    core = "dataflow-runtime"
    assert _by_distribution(build_plugin_manager(autoload=True))[core].status is Status.OK
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "")
    assert _by_distribution(build_plugin_manager(allow=[core]))[core].status is Status.OK


# -- broken plugins --------------------------------------------------------------------------
def test_a_plugin_that_fails_to_import_is_reported_and_skipped(fake_distribution) -> None:
    fake_distribution(
        "dataflow-broken",
        entry_points={"boom": "dataflow_broken_mod"},
        modules={"dataflow_broken_mod": "raise RuntimeError('no GPU driver found')\n"},
        version="2.0",
    )
    fake_distribution(
        "dataflow-fine",
        entry_points={"fine": "dataflow_fine_mod"},
        modules={"dataflow_fine_mod": _planner_module("fine", "fine-planner")},
    )
    with pytest.warns(PluginWarning, match="'dataflow-broken'.*no GPU driver found"):
        manager = build_plugin_manager(allow=["dataflow-broken", "dataflow-fine"])
    reports = _by_distribution(manager)
    broken = reports["dataflow-broken"]
    assert broken.status is Status.BROKEN
    assert broken.version == "2.0"
    assert broken.entry_point == "boom = dataflow_broken_mod"
    assert broken.reason == "import failed: RuntimeError: no GPU driver found"
    assert reports["dataflow-fine"].status is Status.OK
    assert manager.planners().names() == ["fine-planner"]


def test_a_registry_hook_that_raises_leaves_the_plugin_out_whole(fake_distribution) -> None:
    source = (
        "from dataflow import hookimpl\n"
        "from dataflow.registry import FeedSpec\n"
        "@hookimpl\n"
        "def dataflow_feeds():\n"
        "    return [FeedSpec('half', open)]\n"
        "@hookimpl\n"
        "def dataflow_planners():\n"
        "    raise KeyError('config')\n"
    )
    fake_distribution(
        "dataflow-half", entry_points={"half": "half_mod"}, modules={"half_mod": source}
    )
    with pytest.warns(PluginWarning):
        manager = build_plugin_manager(allow=["dataflow-half"])
    report = _by_distribution(manager)["dataflow-half"]
    assert report.status is Status.BROKEN
    assert report.reason == "dataflow_planners raised KeyError: 'config'"
    assert len(manager.feeds()) == 0 and len(manager.planners()) == 0
    assert manager.get_plugin("dataflow-half:half") is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            "return PlannerSpec('p', plan)",
            "dataflow_planners returned PlannerSpec, expected a list",
        ),
        ("return ['p']", "dataflow_planners returned 'p' (str), expected PlannerSpec"),
        (
            "return [FeedSpec('f', plan)]",
            "dataflow_planners returned FeedSpec(scheme='f',",
        ),
    ],
)
def test_a_registry_hook_returning_the_wrong_type_is_broken(
    isolated_plugin_manager, body: str, reason: str
) -> None:
    namespace: dict = {}
    exec(
        "from dataflow import hookimpl\n"
        "from dataflow.registry import FeedSpec, PlannerSpec\n"
        "def plan(program, budget_bytes): return program\n"
        f"class Wrong:\n    @hookimpl\n    def dataflow_planners(self):\n        {body}\n",
        namespace,
    )
    with pytest.warns(PluginWarning):
        manager = isolated_plugin_manager(namespace["Wrong"]())
    (report,) = manager.reports()
    assert report.status is Status.BROKEN and reason in report.reason


def test_an_unknown_hook_is_broken_not_a_crash(isolated_plugin_manager) -> None:
    class Typo:
        @hookimpl
        def dataflow_famlies(self):
            return []

    with pytest.warns(PluginWarning, match="dataflow_famlies"):
        manager = isolated_plugin_manager(Typo())
    (report,) = manager.reports()
    assert report.status is Status.BROKEN
    assert report.reason.startswith("implements unknown hook(s) dataflow_famlies; known: ")
    assert "dataflow_families" in report.reason
    manager.check_pending()  # nothing left that pluggy would reject


def test_a_hook_with_arguments_the_spec_lacks_is_broken(isolated_plugin_manager) -> None:
    class Extra:
        @hookimpl
        def dataflow_planners(self, program):
            return []

    with pytest.warns(PluginWarning):
        manager = isolated_plugin_manager(Extra())
    (report,) = manager.reports()
    assert report.status is Status.BROKEN and "cannot register" in report.reason
    assert "program" in report.reason


def test_a_registry_hook_cannot_be_a_wrapper(isolated_plugin_manager) -> None:
    class Wrapper:
        @hookimpl(wrapper=True)
        def dataflow_planners(self):
            return (yield)

    with pytest.warns(PluginWarning):
        manager = isolated_plugin_manager(Wrapper())
    (report,) = manager.reports()
    assert report.reason == "dataflow_planners is a registry hook and cannot be a wrapper"


def test_a_lookup_miss_mentions_broken_plugins(fake_distribution) -> None:
    fake_distribution(
        "dataflow-family-gpt2",
        entry_points={"gpt2": "gpt2_mod"},
        modules={"gpt2_mod": "import dataflow_no_such_dependency\n"},
    )
    with pytest.warns(PluginWarning):
        manager = build_plugin_manager(allow=["dataflow-family-gpt2"])
    with pytest.raises(UnknownNameError) as failure:
        manager.families().get("gpt2")
    assert "broken plugins (not loaded): dataflow-family-gpt2" in str(failure.value)


# -- registries ------------------------------------------------------------------------------
def test_a_duplicate_name_across_distributions_names_both(fake_distribution) -> None:
    for name in ("dataflow-planner-a", "dataflow-planner-b"):
        module = name.replace("-", "_")
        fake_distribution(
            name,
            entry_points={"plugin": module},
            modules={module: _planner_module(name, "same")},
        )
    manager = build_plugin_manager(allow=["dataflow-planner-a", "dataflow-planner-b"])
    with pytest.raises(DuplicateNameError) as failure:
        manager.planners()
    message = str(failure.value)
    assert "planner name 'same' is registered by distribution 'dataflow-planner-a' and by " in (
        message
    )
    assert "'dataflow-planner-b'" in message and LOAD_PLUGINS_ENV in message
    assert [str(conflict) for conflict in manager.conflicts()] == [message]
    assert len(manager.families()) == 0  # other registries still answer


def test_a_duplicate_within_one_plugin_is_an_error(isolated_plugin_manager) -> None:
    class Twice:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("p", _plan), PlannerSpec("p", _plan)]

    manager = isolated_plugin_manager(Twice())
    with pytest.raises(DuplicateNameError, match="registered twice by distribution"):
        manager.planners()


def test_records_come_sorted_by_name_from_every_plugin(isolated_plugin_manager) -> None:
    class First:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("zeta", _plan), PlannerSpec("alpha", _plan)]

    class Second:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("mid", _plan)]

    manager = isolated_plugin_manager(First(), Second())
    assert manager.planners().names() == ["alpha", "mid", "zeta"]
    assert [spec.name for spec in manager.planners()] == ["alpha", "mid", "zeta"]
    assert manager.planners().distribution_of("mid").endswith("Second")


def test_a_lookup_miss_lists_known_names_and_the_list_command(isolated_plugin_manager) -> None:
    class Two:
        @hookimpl
        def dataflow_families(self):
            return [FamilySpec("llama3", "", dict), FamilySpec("gpt2", "", dict)]

    manager = isolated_plugin_manager(Two())
    with pytest.raises(UnknownNameError) as failure:
        manager.families().get("gpt3")
    assert str(failure.value) == (
        "no family named 'gpt3'; known: gpt2, llama3. Run `dataflow plugins list` to see "
        "which plugins are loaded and which are broken."
    )
    assert isinstance(failure.value, LookupError)


def test_a_plugin_added_later_is_in_the_next_registry(isolated_plugin_manager) -> None:
    class Late:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("late", _plan)]

    manager = isolated_plugin_manager()
    assert len(manager.planners()) == 0
    assert manager.add_plugin(Late(), distribution="dataflow-late", version="3.1")
    assert manager.planners().distribution_of("late") == "dataflow-late"
    with pytest.warns(PluginWarning, match="cannot register"):
        assert not manager.add_plugin(manager.get_plugins().pop(), distribution="again")


# -- the default manager ---------------------------------------------------------------------
def test_the_default_manager_is_built_once_and_can_be_replaced() -> None:
    previous = plugins.set_default_plugin_manager(None)
    try:
        first = get_plugin_manager()
        assert get_plugin_manager() is first
        assert get_plugin_manager(allow=["dataflow-runtime"]) is not first  # arguments: a fresh one
        isolated = plugins.isolated_plugin_manager()
        assert plugins.set_default_plugin_manager(isolated) is first
        assert get_plugin_manager() is isolated
        assert plugins.planners() is not None and len(plugins.planners()) == 0
    finally:
        plugins.set_default_plugin_manager(previous)


def test_an_isolated_manager_ignores_entry_points_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "dataflow-runtime")
    assert plugins.isolated_plugin_manager().reports() == []


def test_hook_names_are_the_specs() -> None:
    assert hook_names() == [
        "dataflow_cli_commands",
        "dataflow_families",
        "dataflow_feeds",
        "dataflow_kernels",
        "dataflow_optimizers",
        "dataflow_planners",
        "dataflow_resolvers",
        "dataflow_trainer_kinds",
    ]


# -- one test per hook (tests/test_hookspecs_docs.py requires test_hook_<name>) ---------------
def test_hook_dataflow_families(isolated_plugin_manager) -> None:
    loaded = []

    class Families:
        @hookimpl
        def dataflow_families(self):
            return [FamilySpec("toy", "a toy family", lambda: loaded.append("toy") or "family")]

    manager = isolated_plugin_manager(Families())
    assert [[spec.name for spec in specs] for specs in manager.hook.dataflow_families()] == [
        ["toy"]
    ]
    spec = plugins.families().get("toy")  # the fixture made it the default
    assert loaded == [] and spec.load() == "family" and loaded == ["toy"]


def test_hook_dataflow_resolvers(isolated_plugin_manager) -> None:
    class Resolvers:
        @hookimpl
        def dataflow_resolvers(self):
            return [ResolverSpec("eager", lambda program: lambda task: task.compute_key)]

    isolated_plugin_manager(Resolvers())
    program = tiny_chain()
    resolver = plugins.resolvers().get("eager").build(program)
    assert resolver(program.tasks[0]) == "matmul"


class _Kernels:
    """Three matmul variants (one per device kind and a reference) and a softmax."""

    @hookimpl
    def dataflow_kernels(self):
        return [
            KernelVariant("matmul", "reference", lambda: "ref"),
            KernelVariant("matmul", "triton", lambda: "fast", devices=("cuda",), priority=5),
            KernelVariant("matmul", "blocked", lambda: "cpu", devices=("cpu",), priority=1),
            KernelVariant("softmax", "reference", lambda: "soft"),
        ]


def test_hook_dataflow_kernels(isolated_plugin_manager) -> None:
    isolated_plugin_manager(_Kernels())
    kernels = plugins.kernels()
    assert kernels.names() == [
        "matmul/blocked",
        "matmul/reference",
        "matmul/triton",
        "softmax/reference",
    ]
    assert [v.name for v in kernels.for_op("matmul")] == ["triton", "blocked", "reference"]
    assert [v.name for v in kernels.for_op("matmul", device="cpu")] == ["blocked", "reference"]
    assert kernels.get("matmul/triton").load() == "fast"
    with pytest.raises(UnknownNameError, match="no kernel op named 'conv'; known: matmul, softmax"):
        kernels.for_op("conv")


def test_a_pinned_kernel_variant_comes_first_where_it_runs(
    isolated_plugin_manager, monkeypatch
) -> None:
    from dataflow.registry.registry import PIN_ENV, pinned_variants

    isolated_plugin_manager(_Kernels())
    kernels = plugins.kernels()
    monkeypatch.setenv(PIN_ENV, " matmul = reference ")
    assert [v.name for v in kernels.for_op("matmul")] == ["reference", "triton", "blocked"]
    assert [v.name for v in kernels.for_op("matmul", device="cuda")] == ["reference", "triton"]
    monkeypatch.setenv(PIN_ENV, "matmul=triton")  # not a CPU variant: the CPU keeps its order
    assert [v.name for v in kernels.for_op("matmul", device="cpu")] == ["blocked", "reference"]
    monkeypatch.setenv(PIN_ENV, "matmul=cudnn")
    with pytest.raises(ValueError, match="DATAFLOW_KERNELS: op matmul has no variant 'cudnn'; its"):
        kernels.for_op("matmul")
    assert pinned_variants("") == {}
    assert pinned_variants("a=x, b=y,") == {"a": "x", "b": "y"}
    with pytest.raises(ValueError, match="DATAFLOW_KERNELS: 'attention' is not OP=NAME"):
        pinned_variants("attention")


def test_every_pin_is_checked_before_any_kernel_loads(isolated_plugin_manager, monkeypatch) -> None:
    from dataflow.registry.registry import PIN_ENV

    isolated_plugin_manager(_Kernels())
    kernels = plugins.kernels()
    monkeypatch.setenv(PIN_ENV, "softmax=reference,matmul=blocked")
    assert kernels.check_pins() == {"softmax": "reference", "matmul": "blocked"}
    monkeypatch.setenv(PIN_ENV, "matmul=blocked,conv=fast")  # for_op("matmul") never sees conv
    with pytest.raises(
        ValueError, match="DATAFLOW_KERNELS: no kernel op 'conv'; the ops: matmul, "
    ):
        kernels.check_pins()
    monkeypatch.setenv(PIN_ENV, "softmax=fast")
    with pytest.raises(
        ValueError, match="op softmax has no variant 'fast'; its variants: reference"
    ):
        kernels.check_pins()


def test_hook_dataflow_feeds(isolated_plugin_manager) -> None:
    opened = []

    class Feeds:
        @hookimpl
        def dataflow_feeds(self):
            return [FeedSpec("shards", lambda location, **options: opened.append(location) or 7)]

    isolated_plugin_manager(Feeds())
    assert plugins.feeds().open("shards:data/tok:v2") == 7
    assert opened == ["data/tok:v2"]
    with pytest.raises(ValueError, match="feed spec 'data/tok' has no scheme.*one of: shards"):
        plugins.feeds().open("data/tok")
    with pytest.raises(UnknownNameError, match="no feed scheme named 'text'"):
        plugins.feeds().open("text:corpus.txt")


def test_hook_dataflow_planners(isolated_plugin_manager) -> None:
    class Planners:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("identity", lambda program, budget_bytes, **options: program)]

    isolated_plugin_manager(Planners())
    program = tiny_chain()
    assert plugins.planners().get("identity").plan(program, 1 << 20) is program


def test_hook_dataflow_trainer_kinds(isolated_plugin_manager) -> None:
    def open_trainer(options, *, device):
        return ("trainer", options, device)

    class Kinds:
        @hookimpl
        def dataflow_trainer_kinds(self):
            return [TrainerKindSpec("echo", "a test kind", open_trainer, ("a",), ("b",))]

    isolated_plugin_manager(Kinds())
    spec = plugins.trainer_kinds().get("echo")
    assert (spec.load_args, spec.step_args) == (("a",), ("b",))
    assert spec.open({"a": 1}, device="cpu") == ("trainer", {"a": 1}, "cpu")
    with pytest.raises(UnknownNameError, match="echo"):
        plugins.trainer_kinds().get("rl-typo")
    with pytest.raises(ValueError, match="'tokens' is dataflow serve-trainer's own kind"):
        TrainerKindSpec("tokens", "shadows the server's own", open_trainer)


def test_hook_dataflow_cli_commands(isolated_plugin_manager) -> None:
    @click.command("hello")
    def hello() -> None:
        click.echo("hello from a plugin")

    class Commands:
        @hookimpl
        def dataflow_cli_commands(self):
            return [hello]

    isolated_plugin_manager(Commands())
    assert plugin_commands() == [hello]


def test_a_plugin_command_clashing_with_a_builtin_is_an_error(isolated_plugin_manager) -> None:
    class Clash:
        @hookimpl
        def dataflow_cli_commands(self):
            return [click.Command("validate")]

    isolated_plugin_manager(Clash())
    with pytest.raises(click.ClickException, match="command name 'validate' is registered by"):
        plugin_commands()


def test_a_plugin_command_needs_a_valid_name(isolated_plugin_manager) -> None:
    class Nameless:
        @hookimpl
        def dataflow_cli_commands(self):
            return [click.Command(None)]

    with pytest.warns(PluginWarning, match="command '' is not a valid name"):
        isolated_plugin_manager(Nameless())
