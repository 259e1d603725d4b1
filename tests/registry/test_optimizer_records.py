"""``dataflow_optimizers``: the record a plugin returns (state fields with shapes relative
to the parameter, typed arguments, the update) and how the plugin manager collects it."""

from __future__ import annotations

import pytest

from dataflow import OptimizerArg, OptimizerSpec, StateField, hookimpl, plugins
from dataflow.registry import DuplicateNameError


def _update(ops, params, grads, states, *, step, policy, weight_decay, roles) -> None:
    for p, g, m in zip(params, grads, states["momentum"], strict=True):
        m[:] = [policy["momentum"] * a + b for a, b in zip(m, g, strict=True)]
        p[:] = [a - policy["lr"] * b for a, b in zip(p, m, strict=True)]


def _rows(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    return shape[:1] if role == "block" else (0,)


SGD = OptimizerSpec(
    "sgd",
    "plain SGD with momentum",
    (StateField("momentum"), StateField("rows", _rows, "float32")),
    _update,
    arguments=(
        OptimizerArg("momentum", "float", 0.9, "the momentum"),
        OptimizerArg("nesterov", "bool", False),
        OptimizerArg("warm", "int", 0),
    ),
)


class _Optimizers:
    @hookimpl
    def dataflow_optimizers(self):
        return [SGD]


def test_hook_dataflow_optimizers(isolated_plugin_manager) -> None:
    manager = isolated_plugin_manager(_Optimizers())
    assert [[s.name for s in specs] for specs in manager.hook.dataflow_optimizers()] == [["sgd"]]
    spec = plugins.optimizers().get("sgd")  # the fixture made the manager the default
    assert spec.state_fields == ("momentum", "rows")
    params, grads, states = [[1.0, 2.0]], [[1.0, -1.0]], {"momentum": [[0.0, 0.0]]}
    spec.update(
        {}, params, grads, states, step=1, policy={"lr": 0.5, **spec.defaults()},
        weight_decay=0.0, roles=["block"],
    )  # fmt: skip
    assert params == [[0.5, 2.5]] and states["momentum"] == [[1.0, -1.0]]
    report = next(r for r in manager.reports() if r.hooks == ("dataflow_optimizers",))
    assert report.registers == {"optimizers": ("sgd",)}


def test_state_shapes_are_relative_to_the_parameter() -> None:
    momentum, rows = SGD.state
    assert momentum.shape((4, 3), "head") == (4, 3) and momentum.dtype is None
    assert rows.shape((4, 3), "block") == (4,) and rows.shape((4, 3), "embed") == (0,)


def test_arguments_are_typed_and_unknown_ones_listed() -> None:
    assert SGD.parse_args(["momentum=0.5", "nesterov=yes", " warm = 3"]) == {
        "momentum": 0.5,
        "nesterov": True,
        "warm": 3,
    }
    with pytest.raises(ValueError, match="optimizer 'sgd' has no argument 'beta'; known: "
                       "momentum, nesterov, warm"):  # fmt: skip
        SGD.parse_args(["beta=1"])
    with pytest.raises(ValueError, match="momentum='fast': momentum takes a number"):
        SGD.parse_args(["momentum=fast"])
    with pytest.raises(ValueError, match="'momentum' is not NAME=VALUE"):
        SGD.parse_args(["momentum"])
    with pytest.raises(ValueError, match="nesterov='maybe': nesterov takes true or false"):
        SGD.parse_args(["nesterov=maybe"])


def test_a_name_registered_twice_is_an_error(isolated_plugin_manager) -> None:
    manager = isolated_plugin_manager(_Optimizers(), _Optimizers())
    with pytest.raises(DuplicateNameError, match="sgd"):
        manager.optimizers()


def test_a_record_of_the_wrong_type_breaks_only_its_plugin(isolated_plugin_manager) -> None:
    class Wrong:
        @hookimpl
        def dataflow_optimizers(self):
            return ["sgd"]

    with pytest.warns(plugins.PluginWarning, match="expected OptimizerSpec"):
        manager = isolated_plugin_manager(Wrong(), _Optimizers())
    assert manager.optimizers().names() == ["sgd"]
