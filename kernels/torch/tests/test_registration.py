"""What the package registers, and what ``dataflow_training.ops.load_ops`` picks from it."""

from __future__ import annotations

import inspect

import pytest

from dataflow.registry import KernelVariant

DETERMINISTIC = {
    "adamw/torch": True,
    "adamw/torch-reference": True,
    "attention/torch": False,
    "attention/torch-math": True,
    "chunked_cross_entropy/torch": True,
    "gelu/torch": True,
    "layer_norm/torch": True,
    "linear/torch": True,
    "rms_norm/torch": True,
    "silu/torch": True,
}


def test_every_training_op_has_a_variant_on_cpu_and_cuda(manager) -> None:
    ops = pytest.importorskip("dataflow_training.ops")
    registry = manager.kernels()
    for device in ("cpu", "cuda"):
        for op in ops.OP_NAMES:
            assert registry.for_op(op, device=device), f"{op} has no variant on {device}"
    assert {variant.op for variant in registry} == set(ops.OP_NAMES)


def test_determinism_flags(manager) -> None:
    assert {v.key: v.deterministic for v in manager.kernels()} == DETERMINISTIC


def test_the_default_variant_is_named_torch_and_preferred(manager) -> None:
    registry = manager.kernels()
    for op in {variant.op for variant in registry}:
        for device in ("cpu", "cuda"):
            best, *others = registry.for_op(op, device=device)
            assert best.name == "torch" and best.priority == 0
            assert all(other.priority < 0 for other in others)


def test_variants_have_descriptions_and_both_devices(manager) -> None:
    for variant in manager.kernels():
        assert isinstance(variant, KernelVariant)
        assert variant.description and variant.devices == ("cpu", "cuda")


def test_signatures_match_the_documented_ops(manager) -> None:
    """Parameter names and kinds as ``dataflow_training.ops`` documents them."""
    expected = {
        "attention": "(q, k, v, *, causal)",
        "layer_norm": "(x, weight, bias, eps)",
        "rms_norm": "(x, weight, eps)",
        "gelu": "(x)",
        "silu": "(x)",
        "linear": "(x, weight, bias=None)",
        "chunked_cross_entropy": "(hidden, weight, targets, chunk_tokens)",
        "adamw": "(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay)",
    }
    for variant in manager.kernels():
        signature = inspect.signature(variant.load())
        bare = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        assert str(bare) == expected[variant.op], variant.key


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_load_ops_picks_the_torch_variants(isolated_plugin_manager, device) -> None:
    training_ops = pytest.importorskip("dataflow_training.ops")
    from dataflow_kernels_torch import adamw, cross_entropy, functional, plugin

    isolated_plugin_manager(plugin)
    ops = training_ops.load_ops(device)
    assert ops["attention"] is functional.attention
    assert ops["adamw"] is adamw.adamw_fused
    assert ops["chunked_cross_entropy"] is cross_entropy.chunked_cross_entropy
    assert set(ops) == set(training_ops.OP_NAMES)


def test_load_ops_deterministic_picks_the_reproducible_attention(isolated_plugin_manager):
    training_ops = pytest.importorskip("dataflow_training.ops")
    from dataflow_kernels_torch import adamw, functional, plugin

    isolated_plugin_manager(plugin)
    ops = training_ops.load_ops("cuda", deterministic=True)
    assert ops["attention"] is functional.attention_math
    assert ops["adamw"] is adamw.adamw_fused
    assert ops["layer_norm"] is functional.layer_norm
