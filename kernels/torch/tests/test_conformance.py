"""The package passes dataflow's conformance tests for kernel plugins."""

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
)


class TestTorchKernels(KernelConformance):
    distribution = "dataflow-kernels-torch"
    expected_names = EXPECTED_VARIANTS
