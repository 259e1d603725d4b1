"""Errors from the family contract name what is wrong, and the typed step layout says
what every task and object is (protocol v2 on the toy families)."""

from __future__ import annotations

import attrs
import pytest
import torch
from dataflow_training.check.verify import check_state_keys
from dataflow_training.drive.tasks import TrainingTasks
from dataflow_training.drive.values import start_values
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import FamilyContractError, LayerSpec, TensorSpec
from dataflow_training.step.keys import ComputeKeyError, family_key, optimizer_key, parse
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import lower
from dataflow_training.testing.toy import Block, ToyFamily, plain_ops
from dataflow_training.testing.toy_moe import ToyMoEFamily

from dataflow import Engine, plan

TRAIN = TrainConfig(seq_len=4, batch=2, rounds=2)


def _run_one_step(family, lowered) -> None:
    config = family.config("small")
    state = {k: v.detach() for k, v in family.reference_model(config).state_dict().items()}

    def data(step, round_):
        g = torch.Generator().manual_seed(round_)
        return tuple(torch.randint(0, config.vocab, (2, 4), generator=g) for _ in range(2))

    planned = plan(lowered.program, 2**30)
    with Engine("torch") as engine:
        resolver = TrainingTasks(lowered.with_program(planned.program), ops=plain_ops())
        engine.load(planned, resolver, initial=start_values(lowered, state, data))
        engine.run()


def test_compute_keys_are_built_and_parsed_in_one_place() -> None:
    assert parse(family_key("gpt2", "block", "backward")).phase == "backward"
    assert parse(optimizer_key("adamw")).is_optimizer
    with pytest.raises(ComputeKeyError, match=r"'gpt2\.head\.forward' is not a training key"):
        parse("gpt2.head.forward")


def test_the_step_layout_gives_every_task_its_objects_by_role() -> None:
    program = lower(ToyMoEFamily(), "toy_moe_tiny", TRAIN).program
    layout = StepLayout.of(program)
    fwd = layout.tasks["fwd_0_1_0"]
    assert fwd.inputs == {"x": ("y_0_1_0",), "w": ("W_0", "W_0.experts")}
    assert fwd.mutates == {"aux": ("Aux_0",)}
    assert fwd.outputs == {"y": ("y_0_1_1",), "saved": ("A_0_1_0",), "aux_temp": ("AuxTemp_0_1_0",)}
    # only the last round's backward reads the step's Aux
    assert "aux" not in layout.tasks["bwd_0_0_0"].inputs
    assert layout.tasks["bwd_0_1_0"].inputs["aux"] == ("Aux_0",)
    assert layout.tasks["bwd_0_1_0"].inputs["aux_temp"] == ("AuxTemp_0_1_0",)
    # experts are their own group: their own gradient, state and optimizer task
    assert {t.id for t in program.tasks if t.kind == "opt"} >= {"opt_0_1_0", "opt_0_1_0.experts"}
    roles = {obj.id: obj.role for obj in program.objects}
    assert roles["AuxTemp_0_0_1"] == "aux_temp" and roles["Aux_1"] == "aux"
    assert program.final_locations["Aux_1"] == "slow"
    assert layout.packed["AuxTemp_0_0_1"].layout.entry("ids").dtype == "int32"
    assert StepLayout.of(program) == layout  # the metadata round trip is exact


def test_a_program_not_lowered_for_training_is_refused_by_name() -> None:
    program = lower(ToyFamily(), "small", TRAIN).program
    bare = attrs.evolve(program, metadata={})
    with pytest.raises(ValueError, match=r"has no training step layout"):
        StepLayout.of(bare)


def test_a_reference_parameter_no_layer_declares_is_named() -> None:
    family = ToyFamily()
    config = family.config("small")
    state = dict(family.reference_model(config).state_dict())
    state["0.extra"] = torch.zeros(3)
    del state["1.b"]
    with pytest.raises(
        FamilyContractError,
        match=r"not declared by any layer \['0.extra'\]; "
        r"declared but missing \['1.b'\]",
    ):
        check_state_keys(family, config, state)


def test_a_missing_gradient_is_named(monkeypatch) -> None:
    def backward(self, config, params, x, saved, aux_temp, dy, env):
        t = torch.tanh(saved["pre"])
        dpre = dy * (1 - t * t)
        return dy + dpre @ params["w"], {"w": dpre.reshape(-1, 16).T @ x.reshape(-1, 16)}

    monkeypatch.setattr(Block, "backward", backward)
    family = ToyFamily()
    with pytest.raises(
        Exception, match=r"bwd_0_0_2: toy\.block\.backward returned no gradient for dW_2:b"
    ):
        _run_one_step(family, lower(family, "small", TRAIN))


def test_a_saved_tensor_of_the_wrong_shape_is_named(monkeypatch) -> None:
    def forward(self, config, params, x, env):
        pre = env.ops["linear"](x, params["w"], params["b"])
        return x + torch.tanh(pre), {"pre": pre[..., :3]}, {}

    monkeypatch.setattr(Block, "forward", forward)
    family = ToyFamily()
    with pytest.raises(
        Exception,
        match=r"fwd_0_0_0: toy\.block\.forward gave saved tensor 'pre' "
        r"of shape \(2, 4, 3\); declared \(2, 4, 16\)",
    ):
        _run_one_step(family, lower(family, "small", TRAIN))


def test_a_head_tied_to_an_undeclared_parameter_is_named(monkeypatch) -> None:
    family = ToyFamily()
    layers = family.layers(family.config("small"))
    broken = [*layers[:-1], attrs.evolve(layers[-1], tied={"wte": "emb.nope"})]
    monkeypatch.setattr(ToyFamily, "layers", lambda self, config: broken)
    with pytest.raises(FamilyContractError, match=r"head ties 'wte' to 'emb.nope', which no layer"):
        lower(family, "small", TRAIN)


def test_a_family_registered_under_another_name_is_refused(isolated_plugin_manager) -> None:
    from dataflow_training.step.family import load_family

    from dataflow import FamilySpec, hookimpl

    class Plugin:
        @hookimpl
        def dataflow_families(self):
            return [FamilySpec("toy2", "misnamed", ToyFamily)]

    isolated_plugin_manager(Plugin())
    with pytest.raises(
        FamilyContractError, match=r"registered as 'toy2' loads an object named 'toy'"
    ):
        load_family("toy2")


def test_frozen_parameters_get_no_gradient_or_optimizer_state(monkeypatch) -> None:
    family = ToyFamily()
    layers = family.layers(family.config("small"))
    frozen = LayerSpec.single(
        "1",
        "block",
        (TensorSpec("w", (16, 16), trainable=False), TensorSpec("b", (16,), trainable=False)),
    )
    monkeypatch.setattr(
        ToyFamily, "layers", lambda self, config: [*layers[:2], frozen, *layers[3:]]
    )
    program = lower(family, "small", TRAIN).program
    ids = {obj.id for obj in program.objects}
    assert "W_1" in ids and "dW_1" not in ids and "O_1" not in ids
    assert "opt_0_1_1" not in {t.id for t in program.tasks}


def test_moe_recompute_reads_the_routing_verbatim() -> None:
    """recompute uses the ids forward wrote, even where routing again would pick others."""
    family = ToyMoEFamily()
    config = family.config("toy_moe_tiny")
    torch.manual_seed(0)
    state = family.reference_model(config).state_dict()
    params = {n: state[f"0.{n}"].detach() for n in ("router", "w_in", "w_out")}
    from dataflow_training.step.family import Env

    env = Env(plain_ops())
    x = torch.randn(2, 4, config.dim)
    _, saved, aux_temp = family.math("moe").forward(config, params, x, env)
    forced = {"ids": torch.zeros_like(aux_temp["ids"]), "weights": aux_temp["weights"]}
    again = family.math("moe").recompute(config, params, x, forced, env)
    expected = torch.einsum("fd,td->tf", params["w_in"][0], x.reshape(-1, config.dim))
    torch.testing.assert_close(again["pre"][:, 0], expected)
    assert not torch.equal(again["pre"], saved["pre"])


def test_the_optimizer_updates_each_group_as_two_flat_tensors() -> None:
    """Parameters, gradients and Adam moments line up element for element, so one
    update call per weight-decay class covers a whole group (two kernels, not one per
    tensor); a layout that does not line up falls back to per-tensor lists."""
    family = ToyMoEFamily()
    lowered = lower(family, "toy_moe_tiny", TRAIN)
    program = lowered.program
    tasks = TrainingTasks(lowered, ops=plain_ops())
    step = tasks(program.tasks_by_id["opt_0_1_0.experts"])
    assert [(names, spans is not None) for names, _, spans in step.classes] == [
        (["w_in", "w_out"], True)
    ]
    head = tasks(program.tasks_by_id["opt_0_1_head"])
    assert [(names, decayed, spans is not None) for names, decayed, spans in head.classes] == [
        (["g"], False, True)
    ]


def test_a_heterogeneous_stack_gets_a_task_kind_per_block_kind(monkeypatch) -> None:
    family = ToyFamily()
    layers = family.layers(family.config("small"))
    mixed = [*layers[:2], attrs.evolve(layers[2], kind="other"), *layers[3:]]
    monkeypatch.setattr(ToyFamily, "layers", lambda self, config: mixed)
    original = ToyFamily.math
    monkeypatch.setattr(
        ToyFamily, "math", lambda self, kind: original(self, "block" if kind == "other" else kind)
    )
    lowered = lower(family, "small", TRAIN)
    keys = {task.id: task.compute_key for task in lowered.program.tasks}
    assert keys["fwd_0_0_0"] == "toy.block.forward" and keys["fwd_0_0_1"] == "toy.other.forward"
    assert keys["bwd_0_1_1"] == "toy.other.backward"
    _run_one_step(family, lowered)


def test_toy_moe_verify_passes_at_a_tight_budget() -> None:
    """`dataflow verify --family toy_moe` at a tenth above the smallest budget that plans
    and places: the step moves experts, AuxTemp and Aux through the links and still equals
    the reference."""
    pytest.importorskip("dataflow_kernels_torch")
    from dataflow_training.check.verify import step_config, verify

    from dataflow import minimal_budget

    family = ToyMoEFamily()
    train = step_config("fp32", batch=2, seq_len=16, rounds=2)
    program = lower(family, "toy_moe_tiny", train, keep_grads=True).program
    budget = int(1.1 * minimal_budget(program))
    planned = plan(program, budget)
    assert planned.sim.h2d.bytes > 0 and planned.sim.fast_peak_bytes <= budget
    checks = verify("toy_moe", "toy_moe_tiny", budget_bytes=budget)
    failed = [check for check in checks if not check.ok]
    assert not failed, failed
    # each of the 3 steps: a loss per round, a gradient and a weight per parameter
    assert sum(check.level == "step" for check in checks) == 3 * (2 + 2 * 8)


def test_layers_sharing_an_aux_object_must_declare_the_same_tensors(monkeypatch) -> None:
    """``aux_scope="model"``: toy_moe's blocks share ``Aux_moe``; a block declaring other
    tensors for it is named, and so is a scope that is neither "layer" nor "model"."""
    family = ToyMoEFamily()
    layers = family.layers(family.config("toy_moe_tiny"))
    shared = [attrs.evolve(layer, aux_scope="model") if layer.aux else layer for layer in layers]
    monkeypatch.setattr(ToyMoEFamily, "layers", lambda self, config: shared)
    program = lower(family, "toy_moe_tiny", TRAIN).program
    assert [o.id for o in program.objects if o.role == "aux"] == ["Aux_moe"]
    assert [t.id for t in program.tasks if t.params.get("zero_aux")] == ["fwd_0_0_0"]
    other = TensorSpec("counts", (layers[1].aux[0].shape[0] + 1,), dtype="float32")
    broken = [*shared[:2], attrs.evolve(shared[2], aux=(other,)), *shared[3:]]
    monkeypatch.setattr(ToyMoEFamily, "layers", lambda self, config: broken)
    with pytest.raises(FamilyContractError, match=r"layer '1' declares aux tensors .* Aux_moe"):
        lower(family, "toy_moe_tiny", TRAIN)
    with pytest.raises(FamilyContractError, match=r"layer '0': aux_scope must be one of layer"):
        attrs.evolve(layers[1], aux_scope="global")
