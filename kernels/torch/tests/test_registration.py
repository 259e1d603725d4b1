"""What the package registers, and what ``dataflow_training.step.ops.load_ops`` picks from it."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from dataflow import KernelVariant

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
    "chunked_cross_entropy/reference": True,
    "attention_fwd/torch": True,
    "attention_bwd/torch": False,
    "layer_norm_fwd/torch": True,
    "layer_norm_bwd/torch": True,
    "rms_norm_fwd/torch": True,
    "rms_norm_bwd/torch": True,
    "gelu_bwd/torch": True,
    "swiglu_fwd/torch": True,
    "swiglu_bwd/torch": True,
    "adamw_multi/torch": True,
    "adamw_compensated_multi/torch": True,
}
#: The explicit forward/backward ops: each has a torch and a reference variant.
EXPLICIT_OPS = (
    "attention_fwd",
    "attention_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "gelu_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "adamw_multi",
    "adamw_compensated_multi",
    "grouped_mm",
    "grouped_mm_wgrad",
    "gated_delta_rule_fwd",
    "gated_delta_rule_bwd",
    "sparse_attention_fwd",
    "sparse_attention_bwd",
    "sparse_attention_probs",
    "rows_add_masked",
    "rows_put_masked",
    "rows_gather_masked",
    "swiglu_rows_bwd",
)
DETERMINISTIC |= {f"{op}/reference": True for op in EXPLICIT_OPS}
#: the masked row ops (an MoE shard's window): the adds are atomics on CUDA
DETERMINISTIC |= {
    "rows_add_masked/torch": False,
    "rows_put_masked/torch": True,
    "rows_gather_masked/torch": True,
    "swiglu_rows_bwd/torch": True,
}
DETERMINISTIC |= {"grouped_mm/torch": True, "grouped_mm_wgrad/torch": True}
DETERMINISTIC |= {"gated_delta_rule_fwd/torch": True, "gated_delta_rule_bwd/torch": True}
DETERMINISTIC |= {
    "sparse_attention_fwd/torch": True,
    "sparse_attention_bwd/torch": False,
    "sparse_attention_probs/torch": True,
}
#: fla's gated delta rule, CUDA only, registered where fla, einops and triton import
FLA = {"gated_delta_rule_fwd/fla": False, "gated_delta_rule_bwd/fla": False}
if all(importlib.util.find_spec(name) for name in ("fla", "einops", "triton")):
    DETERMINISTIC |= FLA
#: cuDNN's fused attention pair, CUDA only (its backward accumulates with atomics)
CUDNN = {"attention_fwd/cudnn": True, "attention_bwd/cudnn": False}
DETERMINISTIC |= CUDNN
#: Registered only where triton is installed (CUDA only, preferred there).
TRITON = (
    "adamw_multi/triton",
    "adamw_compensated_multi/triton",
    "swiglu_fwd/triton",
    "swiglu_bwd/triton",
    "chunked_cross_entropy/triton",
    "rows_add_masked/triton",
    "rows_put_masked/triton",
    "rows_gather_masked/triton",
    "swiglu_rows_bwd/triton",
)
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    DETERMINISTIC |= dict.fromkeys(TRITON, True) | {"rows_add_masked/triton": False}
#: The older differentiable forwards, still registered for code that uses autograd.
AUTOGRAD_OPS = ("attention", "layer_norm", "rms_norm", "gelu", "silu", "linear")


def test_every_training_op_has_a_variant_on_cpu_and_cuda(manager) -> None:
    ops = pytest.importorskip("dataflow_training.step.ops")
    registry = manager.kernels()
    for device in ("cpu", "cuda"):
        for op in ops.STANDARD_OPS:
            assert registry.for_op(op, device=device), f"{op} has no variant on {device}"
    registered = {variant.op for variant in registry}
    assert set(ops.STANDARD_OPS) <= registered
    assert registered == {*AUTOGRAD_OPS, "chunked_cross_entropy", "adamw", *EXPLICIT_OPS}


def test_determinism_flags(manager) -> None:
    assert {v.key: v.deterministic for v in manager.kernels()} == DETERMINISTIC


def test_the_default_variant_is_named_torch_and_preferred(manager) -> None:
    """On CPU the torch variant (priority 0) leads every op; on CUDA a triton variant
    (priority 10) or the cuDNN attention pair (5, measured faster in compiled tasks)
    leads where registered, the torch variant next; every other alternative has a
    negative priority."""
    registry = manager.kernels()
    for op in {variant.op for variant in registry}:
        for device in ("cpu", "cuda"):
            best, *others = registry.for_op(op, device=device)
            if best.key in TRITON:
                assert device == "cuda" and best.priority == 10
                best, *others = others
            if best.key in FLA:
                assert device == "cuda" and best.priority == 10
                best, *others = others
            if best.key in CUDNN:
                assert device == "cuda" and best.priority == 5
                best, *others = others
            assert best.name == "torch" and best.priority == 0
            assert all(other.priority < 0 for other in others)


def test_variants_have_descriptions_and_devices(manager) -> None:
    for variant in manager.kernels():
        assert isinstance(variant, KernelVariant)
        expected = ("cuda",) if variant.key in (*TRITON, *CUDNN, *FLA) else ("cpu", "cuda")
        assert variant.description and variant.devices == expected


def test_signatures_match_the_documented_ops(manager) -> None:
    """Parameter names and kinds as ``dataflow_training.step.ops`` documents them."""
    expected = {
        "attention": "(q, k, v, *, causal)",
        "layer_norm": "(x, weight, bias, eps)",
        "rms_norm": "(x, weight, eps)",
        "gelu": "(x)",
        "silu": "(x)",
        "linear": "(x, weight, bias=None)",
        "chunked_cross_entropy": (
            "(hidden, weight, targets, chunk_tokens, *, grad_scale=1.0, vocab_tiles=False, "
            "vocab=None, d_weight_into=None, scale_by=None)"
        ),
        "adamw": "(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay)",
        "attention_fwd": "(q, k, v, *, causal, scale=None, window=None, mask=None, segments=None)",
        "attention_bwd": (
            "(dout, q, k, v, out, lse, *, causal, scale=None, window=None, mask=None, "
            "segments=None)"
        ),
        "layer_norm_fwd": "(x, weight, bias, eps)",
        "layer_norm_bwd": "(dy, x, mean, rstd, weight, bias)",
        "rms_norm_fwd": "(x, weight, eps)",
        "rms_norm_bwd": "(dy, x, rstd, weight)",
        "gelu_bwd": "(dy, x)",
        "swiglu_fwd": "(gate, up)",
        "swiglu_bwd": "(dy, gate, up)",
        "grouped_mm": "(x, weight, offsets)",
        "grouped_mm_wgrad": "(dy, x, offsets)",
        "gated_delta_rule_fwd": "(q, k, v, g, beta, *, scale=None)",
        "gated_delta_rule_bwd": "(d_out, q, k, v, g, beta, *, scale=None)",
        "sparse_attention_fwd": "(q, k, v, indices, *, scale=None)",
        "sparse_attention_bwd": "(dout, q, k, v, out, lse, indices, *, scale=None)",
        "sparse_attention_probs": "(q, k, lse, indices, *, scale=None)",
        "rows_add_masked": "(rows, into, valid, weights, count, *, slices=1)",
        "rows_put_masked": "(values, index, valid, target)",
        "rows_gather_masked": "(source, index, valid)",
        "swiglu_rows_bwd": "(gate_up, d_act, weights, valid)",
        "adamw_multi": "(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, "
        "weight_decay)",
        "adamw_compensated_multi": "(params, grads, exp_avgs, exp_avg_sqs, compensations, *, "
        "step, lr, beta1, beta2, eps, weight_decay)",
    }
    for variant in manager.kernels():
        if variant.key in (*TRITON, *FLA):  # same functions as the torch variants
            continue
        signature = inspect.signature(variant.load())
        bare = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        assert str(bare) == expected[variant.op], variant.key


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_load_ops_picks_the_torch_variants(isolated_plugin_manager, device) -> None:
    training_ops = pytest.importorskip("dataflow_training.step.ops")
    from dataflow_kernels_torch import adamw, cross_entropy, functional, plugin

    isolated_plugin_manager(plugin)
    ops = training_ops.load_ops(device)
    assert set(ops) == set(training_ops.STANDARD_OPS)
    assert ops["chunked_cross_entropy"] is cross_entropy.chunked_cross_entropy
    older = training_ops.load_ops(device, ("attention", "adamw"))
    assert older["attention"] is functional.attention
    assert older["adamw"] is adamw.adamw_fused


def test_load_ops_deterministic_picks_the_reproducible_attention(isolated_plugin_manager):
    training_ops = pytest.importorskip("dataflow_training.step.ops")
    from dataflow_kernels_torch import adamw, functional, plugin

    isolated_plugin_manager(plugin)
    ops = training_ops.load_ops(
        "cuda", ("attention", "adamw", "layer_norm", "attention_bwd"), deterministic=True
    )
    assert ops["attention"] is functional.attention_math
    assert ops["adamw"] is adamw.adamw_fused
    assert ops["layer_norm"] is functional.layer_norm
    from dataflow_kernels_torch import attention

    assert ops["attention_bwd"] is attention.attention_bwd_reference  # the atomics-free one
