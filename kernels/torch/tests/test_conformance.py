"""The package passes dataflow's conformance tests for kernel plugins."""

import importlib.util

from dataflow.testing import KernelConformance

#: Every variant the package registers; each is checked against its reference in
#: test_functional.py, test_cross_entropy.py or test_adamw.py.
EXPECTED_VARIANTS = (
    "adamw/torch",
    "adamw/torch-reference",
    "attention/torch",
    "attention/torch-math",
    "chunked_cross_entropy/torch",
    "gelu/torch",
    "layer_norm/torch",
    "linear/torch",
    "rms_norm/torch",
    "silu/torch",
    "chunked_cross_entropy/reference",
    "attention_fwd/cudnn",
    "attention_bwd/cudnn",
    *(
        f"{op}/{name}"
        for op in (
            "adamw_multi",
            "attention_bwd",
            "attention_fwd",
            "gelu_bwd",
            "layer_norm_bwd",
            "layer_norm_fwd",
            "rms_norm_bwd",
            "rms_norm_fwd",
            "swiglu_bwd",
            "swiglu_fwd",
        )
        for name in ("reference", "torch")
    ),
    # test_grouped_ops.py
    *(
        f"{op}/{name}"
        for op in ("grouped_mm", "grouped_mm_wgrad")
        for name in ("reference", "torch")
    ),
    # test_rows_ops.py
    *(
        f"{op}/{name}"
        for op in ("rows_add_masked", "rows_put_masked", "rows_gather_masked", "swiglu_rows_bwd")
        for name in ("reference", "torch")
    ),
    # test_delta_rule_ops.py
    *(
        f"{op}/{name}"
        for op in ("gated_delta_rule_fwd", "gated_delta_rule_bwd")
        for name in ("torch", "reference")
    ),
    *(
        ("gated_delta_rule_fwd/fla", "gated_delta_rule_bwd/fla")
        if all(importlib.util.find_spec(name) for name in ("fla", "einops", "triton"))
        else ()
    ),
    # test_sparse_attention.py
    *(
        f"{op}/{name}"
        for op in ("sparse_attention_fwd", "sparse_attention_bwd", "sparse_attention_probs")
        for name in ("torch", "reference")
    ),
    # test_adamw_compensated.py
    "adamw_compensated_multi/reference",
    "adamw_compensated_multi/torch",
    # test_attention_ops.py, test_norm_ops.py, test_elementwise_ops.py, test_adamw_multi.py
    *(
        (
            "adamw_multi/triton",
            "adamw_compensated_multi/triton",
            "swiglu_bwd/triton",
            "swiglu_fwd/triton",
            "chunked_cross_entropy/triton",
            "rows_add_masked/triton",
            "rows_put_masked/triton",
            "rows_gather_masked/triton",
            "swiglu_rows_bwd/triton",
        )
        if importlib.util.find_spec("triton") is not None
        else ()
    ),
)


class TestTorchKernels(KernelConformance):
    distribution = "dataflow-kernels-torch"
    expected_names = EXPECTED_VARIANTS
