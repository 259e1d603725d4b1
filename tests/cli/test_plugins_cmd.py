"""``dataflow plugins list``: the table, ``--json``, ``--hook``, broken and disabled plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import click
import pytest
from click.testing import CliRunner

from dataflow import hookimpl, plugins
from dataflow.cli.plugins_cmd import plugins_group
from dataflow.plugins import DISABLE_AUTOLOAD_ENV, LOAD_PLUGINS_ENV
from dataflow.registry import PlannerSpec
from dataflow.testing.cli import assert_one_line_error, invoke

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
def _fresh_default(monkeypatch: pytest.MonkeyPatch):
    """Each test builds the default manager from its own environment."""
    monkeypatch.delenv(LOAD_PLUGINS_ENV, raising=False)
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    previous = plugins.set_default_plugin_manager(None)
    yield
    plugins.set_default_plugin_manager(previous)


def _list(*args: str) -> click.testing.Result:
    return CliRunner().invoke(plugins_group, ["list", *args], catch_exceptions=False)


def _json(*args: str) -> dict:
    result = _list("--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _dataflow(*args: str, env: dict[str, str] | None = None, pythonpath: str = "") -> dict:
    """Run the installed ``dataflow`` command in a fresh interpreter."""
    clean = {
        k: v for k, v in os.environ.items() if k not in (LOAD_PLUGINS_ENV, DISABLE_AUTOLOAD_ENV)
    }
    if pythonpath:
        clean["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [sys.executable, "-c", "from dataflow.cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
    )
    return {"code": result.returncode, "out": result.stdout, "err": result.stderr}


def test_json_lists_the_core_builtins() -> None:
    payload = _json()
    (core,) = [p for p in payload["plugins"] if p["distribution"] == "dataflow-runtime"]
    assert {key: core[key] for key in ("name", "version", "entry_point", "status")} == {
        "name": "dataflow-runtime:core",
        "version": metadata.version("dataflow-runtime"),
        "entry_point": "core = dataflow.builtins",
        "status": "ok",
    }
    assert set(core) == {
        *("name", "distribution", "version", "entry_point", "hooks", "registers"),
        *("status", "reason"),
    }
    assert payload["conflicts"] == [] and payload["warnings"] == []


@needs_example
def test_json_lists_the_example_plugin_with_what_it_registers() -> None:
    (example,) = [p for p in _json()["plugins"] if p["distribution"] == EXAMPLE]
    assert example["entry_point"] == "planner_example = dataflow_planner_example.plugin"
    assert example["hooks"] == ["dataflow_planners"]
    assert example["registers"] == {"planners": ["keep-all"]}
    assert example["status"] == "ok"


@needs_example
def test_the_table_shows_distribution_hooks_names_and_status() -> None:
    result = CliRunner().invoke(plugins_group, ["list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in (EXAMPLE, "dataflow_planners", "planners: keep-all", "ok", "dataflow.builtins"):
        assert text in result.stdout


@needs_example
def test_hook_filters_to_the_plugins_that_implement_it() -> None:
    for hook in ("dataflow_planners", "dataflow_feeds"):
        listed = _json("--hook", hook)["plugins"]
        assert all(hook in p["hooks"] for p in listed)
        assert (EXAMPLE in [p["distribution"] for p in listed]) is (hook == "dataflow_planners")


def test_hook_filter_with_no_match_says_so(isolated_plugin_manager) -> None:
    isolated_plugin_manager()
    result = _list("--hook", "dataflow_kernels")
    assert result.exit_code == 0 and result.stdout == "no plugin implements dataflow_kernels\n"


def test_an_unknown_hook_is_a_usage_error_naming_the_known_ones() -> None:
    result = CliRunner().invoke(plugins_group, ["list", "--hook", "dataflow_planer"])
    assert result.exit_code == 2
    assert "unknown hook 'dataflow_planer'; known hooks: dataflow_cli_commands," in result.output
    assert "dataflow_planners" in result.output


def test_a_broken_plugin_is_listed_with_its_reason(fake_distribution) -> None:
    fake_distribution(
        "dataflow-broken",
        entry_points={"boom": "dataflow_broken_cli_mod"},
        modules={"dataflow_broken_cli_mod": "raise ImportError('needs libfoo.so')\n"},
    )
    with pytest.warns(plugins.PluginWarning):
        payload = _json()
    (broken,) = [p for p in payload["plugins"] if p["distribution"] == "dataflow-broken"]
    assert broken["status"] == "broken"
    assert broken["reason"] == "import failed: ImportError: needs libfoo.so"
    assert broken["entry_point"] == "boom = dataflow_broken_cli_mod"
    assert any(p["status"] == "ok" for p in payload["plugins"])  # the others still load
    with pytest.warns(plugins.PluginWarning):
        plugins.set_default_plugin_manager(None)
        # Wide enough that no cell folds, whatever the installed plugins register (the
        # kernel packages list many names).
        table = CliRunner().invoke(plugins_group, ["list"], env={"COLUMNS": "500"})
    assert table.exit_code == 0
    assert "broken: import failed: ImportError: needs libfoo.so" in table.stdout


def test_duplicate_names_are_reported_and_exit_1(isolated_plugin_manager) -> None:
    def plan(program, budget_bytes, **options):
        return program

    class One:
        @hookimpl
        def dataflow_planners(self):
            return [PlannerSpec("same", plan)]

    class Two(One):
        pass

    manager = isolated_plugin_manager()
    manager.add_plugin(One(), distribution="dataflow-one")
    manager.add_plugin(Two(), distribution="dataflow-two")
    result = _list("--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["conflicts"] == [
        "planner name 'same' is registered by distribution 'dataflow-one' and by distribution "
        "'dataflow-two'; uninstall one, or leave one out with DATAFLOW_LOAD_PLUGINS (a "
        "comma-separated list of the distributions to load)"
    ]
    table = invoke("plugins", "list")
    assert "conflict: planner name 'same'" in table.stdout
    assert_one_line_error(table, 1, "1 name conflict(s)", "planner name 'same'")


def test_an_allowlist_name_that_matches_nothing_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "dataflow-runtime,dataflow-typo")
    assert _json()["warnings"] == [
        "the allowlist names 'dataflow-typo', but no installed distribution has a dataflow "
        "entry point by that name"
    ]
    assert "warning: the allowlist names 'dataflow-typo'" in _list().stderr


# -- the installed command, in a fresh interpreter ---------------------------------------------
@needs_example
def test_the_command_removes_a_plugin_by_the_allowlist() -> None:
    result = _dataflow("plugins", "list", "--json", env={LOAD_PLUGINS_ENV: "dataflow-runtime"})
    assert result["code"] == 0, result["err"]
    status = {p["distribution"]: p["status"] for p in json.loads(result["out"])["plugins"]}
    assert status["dataflow-runtime"] == "ok" and status[EXAMPLE] == "disabled"


@needs_example
def test_the_command_removes_every_plugin_by_the_kill_switch() -> None:
    result = _dataflow("plugins", "list", "--json", env={DISABLE_AUTOLOAD_ENV: "1"})
    assert result["code"] == 0, result["err"]
    plugins_listed = json.loads(result["out"])["plugins"]
    assert {p["status"] for p in plugins_listed} == {"disabled"}
    assert {p["reason"] for p in plugins_listed} == {f"{DISABLE_AUTOLOAD_ENV} is set"}


def test_a_plugin_subcommand_runs_from_the_dataflow_command(tmp_path) -> None:
    from dataflow.testing import write_distribution

    source = (
        "import click\n"
        "from dataflow import hookimpl\n"
        "@click.command('hello')\n"
        "@click.argument('name')\n"
        "def hello(name):\n"
        "    '''Say hello.'''\n"
        "    click.echo(f'hello {name}')\n"
        "@hookimpl\n"
        "def dataflow_cli_commands():\n"
        "    return [hello]\n"
    )
    write_distribution(
        tmp_path,
        "dataflow-hello",
        entry_points={"hello": "dataflow_hello_cli"},
        modules={"dataflow_hello_cli": source},
    )
    result = _dataflow("hello", "world", pythonpath=str(tmp_path))
    assert (result["code"], result["out"]) == (0, "hello world\n"), result["err"]
    listed = _dataflow("--help", pythonpath=str(tmp_path))
    assert "hello" in listed["out"] and "Say hello." in listed["out"]
    hidden = _dataflow(
        "hello", "world", pythonpath=str(tmp_path), env={LOAD_PLUGINS_ENV: "dataflow-runtime"}
    )
    assert hidden["code"] == 2 and "No such command 'hello'" in hidden["err"]
