"""``dataflow kernels list``: the table, ``--json``, ``--op``, ``--device``, errors.

Most tests register a small kernel plugin of their own through an isolated plugin manager
(no install needed); the ones marked ``needs_torch_kernels`` check the real
``dataflow-kernels-torch`` package and skip when it is not installed.
"""

from __future__ import annotations

import json
from importlib import metadata

import click
import pytest
from click.testing import CliRunner

from dataflow import hookimpl, plugins
from dataflow.cli.kernels_cmd import kernels_group
from dataflow.cli.main import cli
from dataflow.plugins import DISABLE_AUTOLOAD_ENV, LOAD_PLUGINS_ENV
from dataflow.registry import KernelVariant

TORCH_KERNELS = "dataflow-kernels-torch"
#: rich sizes tables from COLUMNS; wide enough that no cell folds.
WIDE = {"COLUMNS": "240"}


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_torch_kernels = pytest.mark.skipif(
    not _installed(TORCH_KERNELS),
    reason=f"{TORCH_KERNELS} is not installed (pip install -e kernels/torch)",
)


def _kernel() -> None:
    """A kernel that is never called: the command only lists records."""


class FakeKernels:
    """Three variants of two ops; ``matmul/slow`` runs on cpu only."""

    @hookimpl
    def dataflow_kernels(self) -> list[KernelVariant]:
        return [
            KernelVariant("matmul", "slow", lambda: _kernel, devices=("cpu",), priority=-5),
            KernelVariant(
                "matmul",
                "fast",
                lambda: _kernel,
                deterministic=False,
                priority=3,
                description="atomics [fast]",
            ),
            KernelVariant("softmax", "plain", lambda: _kernel, description="exp / sum"),
        ]


@pytest.fixture(autouse=True)
def _fresh_default(monkeypatch: pytest.MonkeyPatch):
    """Each test builds the default manager from its own environment."""
    monkeypatch.delenv(LOAD_PLUGINS_ENV, raising=False)
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    previous = plugins.set_default_plugin_manager(None)
    yield
    plugins.set_default_plugin_manager(previous)


@pytest.fixture
def fake(isolated_plugin_manager) -> None:
    isolated_plugin_manager(FakeKernels())


def _list(*args: str) -> click.testing.Result:
    return CliRunner().invoke(kernels_group, ["list", *args], catch_exceptions=False)


def _json(*args: str) -> list[dict]:
    result = _list("--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["variants"]


def test_json_lists_every_field_ops_sorted_best_first(fake) -> None:
    variants = _json()
    assert [(v["op"], v["name"]) for v in variants] == [
        ("matmul", "fast"),
        ("matmul", "slow"),
        ("softmax", "plain"),
    ]
    distribution = variants[0]["distribution"]
    assert variants[0] == {
        "op": "matmul",
        "name": "fast",
        "distribution": distribution,
        "devices": ["cpu", "cuda"],
        "deterministic": False,
        "priority": 3,
        "description": "atomics [fast]",
    }
    assert variants[1]["devices"] == ["cpu"] and variants[1]["deterministic"] is True
    assert variants[1]["description"] == ""


def test_op_filter(fake) -> None:
    assert [v["name"] for v in _json("--op", "matmul")] == ["fast", "slow"]
    assert [v["name"] for v in _json("--op", "softmax")] == ["plain"]


def test_device_filter_leaves_out_variants_that_do_not_run_there(fake) -> None:
    assert [v["name"] for v in _json("--device", "cuda")] == ["fast", "plain"]
    assert [v["name"] for v in _json("--device", "cpu", "--op", "matmul")] == ["fast", "slow"]


def test_unknown_op_is_an_error_naming_the_known_ops(fake) -> None:
    result = _list("--op", "attention")
    assert result.exit_code == 2
    assert "no kernel op named 'attention'" in result.output
    assert "known: matmul, softmax" in result.output


def test_unknown_device_is_an_error_naming_the_devices(fake) -> None:
    result = _list("--device", "tpu")
    assert result.exit_code == 2
    assert "no kernel variant runs on 'tpu'; devices named: cpu, cuda" in result.output


def test_table_shows_every_column(fake) -> None:
    result = CliRunner().invoke(kernels_group, ["list"], env=WIDE, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    for header in ("Op", "Variant", "Distribution", "Devices", "Deterministic", "Priority"):
        assert header in out
    fast_line = next(line for line in out.splitlines() if " fast " in line)
    for cell in ("matmul", "cpu, cuda", "no", "3", "atomics [fast]"):
        assert cell in fast_line  # rich markup in a description is printed as text
    slow_line = next(line for line in out.splitlines() if " slow " in line)
    assert "yes" in slow_line and "-5" in slow_line


def test_table_title_names_the_device(fake) -> None:
    result = _list("--device", "cpu")
    assert "dataflow kernel variants on cpu" in result.output


def test_no_variants_says_what_to_install(isolated_plugin_manager) -> None:
    isolated_plugin_manager()
    result = _list()
    assert result.exit_code == 0
    assert "no kernel variants registered" in result.output
    assert TORCH_KERNELS in result.output
    assert _json() == []
    unknown = _list("--op", "attention")
    assert unknown.exit_code == 2 and "no kernel variants are registered at all" in unknown.output


def test_a_duplicate_variant_is_an_error_naming_both(isolated_plugin_manager) -> None:
    class Again:
        @hookimpl
        def dataflow_kernels(self) -> list[KernelVariant]:
            return [KernelVariant("softmax", "plain", lambda: _kernel)]

    isolated_plugin_manager(FakeKernels(), Again())
    result = _list()
    assert result.exit_code == 1
    assert "'softmax/plain' is registered" in result.output


def test_a_broken_plugin_is_warned_about(isolated_plugin_manager) -> None:
    class Broken:
        @hookimpl
        def dataflow_kernels(self) -> list[KernelVariant]:
            raise RuntimeError("no compiler")

    with pytest.warns(plugins.PluginWarning, match="no compiler"):
        isolated_plugin_manager(FakeKernels(), Broken())
    result = CliRunner().invoke(kernels_group, ["list", "--json"])
    assert result.exit_code == 0
    assert [v["op"] for v in json.loads(result.stdout)["variants"]] == [
        "matmul",
        "matmul",
        "softmax",
    ]
    assert "warning: broken plugins" in result.stderr and "Broken" in result.stderr


def test_registered_as_a_builtin_command() -> None:
    result = CliRunner().invoke(cli, ["kernels", "list", "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "--op NAME" in result.output and "--device DEVICE" in result.output


@needs_torch_kernels
def test_the_torch_kernels_cover_the_training_ops() -> None:
    ops = pytest.importorskip("dataflow_training.step.ops")
    variants = [v for v in _json() if v["distribution"] == TORCH_KERNELS]
    assert set(ops.STANDARD_OPS) <= {v["op"] for v in variants}
    by_key = {f"{v['op']}/{v['name']}": v for v in variants}
    assert by_key["attention/torch"]["deterministic"] is False
    assert by_key["attention/torch-math"]["deterministic"] is True
    assert by_key["adamw/torch"]["priority"] > by_key["adamw/torch-reference"]["priority"]


@needs_torch_kernels
def test_the_torch_kernels_on_cuda_in_preference_order() -> None:
    attention = [
        v["name"]
        for v in _json("--op", "attention", "--device", "cuda")
        if v["distribution"] == TORCH_KERNELS
    ]
    assert attention == ["torch", "torch-math"]


@needs_torch_kernels
def test_the_torch_kernels_through_the_dataflow_command() -> None:
    result = CliRunner().invoke(cli, ["kernels", "list", "--op", "chunked_cross_entropy"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert TORCH_KERNELS in result.output and "chunked_cross_entropy" in result.output
