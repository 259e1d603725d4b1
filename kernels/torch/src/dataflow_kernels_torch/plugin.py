"""The module the ``dataflow`` entry point names: it only registers kernel variants.

Kept tiny on purpose: dataflow imports it whenever it builds a plugin manager (every CLI
call), so torch is imported only when a variant's ``load()`` is called.

Priorities: a built-in default is 0 and a slower alternative of the same op is -10, so a
kernel package meant to replace a built-in registers a positive priority.

Determinism (``deterministic=True``: two runs on the same device, inputs and software give
the same bits):

- ``attention/torch`` is False. On CUDA, PyTorch's memory-efficient attention backward
  splits the keys and accumulates with atomics unless deterministic mode is on (it warns
  "Memory Efficient attention defaults to a non-deterministic algorithm",
  aten/src/ATen/native/transformers/cuda/attention_backward.cu), flash attention's
  backward warns the same, and the ``scaled_dot_product_attention`` docstring says the
  cuDNN backend may pick a nondeterministic algorithm. (Under
  ``torch.use_deterministic_algorithms(True)`` both backwards turn deterministic; dataflow
  does not set that global mode.) Measured on an H200: 10 runs, 5 different dq
  (benchmarks/variants.py).
- ``attention/torch-math`` is True: the math backend is matmul and softmax, whose
  backward has no atomics.
- The rest are elementwise ops, row-wise norms and matmuls, none of which
  ``torch.use_deterministic_algorithms`` lists as nondeterministic. Matmuls (linear, the
  cross-entropy chunks) are reproducible on one CUDA stream, as dataflow's engine runs
  compute; across streams cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (PyTorch's
  reproducibility notes). The cross-entropy's one-hot subtraction scatters one index per
  row, so its adds never collide.

Each claim of True is checked on CUDA by ``tests/test_determinism.py`` (bitwise-equal
repeated runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from dataflow import hookimpl
from dataflow.registry import KernelVariant

_PACKAGE = "dataflow_kernels_torch"


def _loader(module: str, name: str) -> Callable[[], Callable[..., Any]]:
    """``load()`` for ``dataflow_kernels_torch.<module>.<name>``, imported when called."""

    def load() -> Callable[..., Any]:
        return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), name)

    load.__qualname__ = f"load[{module}.{name}]"
    return load


@hookimpl
def dataflow_kernels() -> list[KernelVariant]:
    return [
        KernelVariant(
            "attention",
            "torch",
            _loader("functional", "attention"),
            deterministic=False,
            priority=0,
            description="F.scaled_dot_product_attention; PyTorch picks flash, "
            "memory-efficient, cuDNN or math (fused backward not bitwise reproducible)",
        ),
        KernelVariant(
            "attention",
            "torch-math",
            _loader("functional", "attention_math"),
            deterministic=True,
            priority=-10,
            description="F.scaled_dot_product_attention on the math backend only "
            "(sdpa_kernel(SDPBackend.MATH)): slower, (seq, seq) scores, reproducible",
        ),
        KernelVariant(
            "layer_norm",
            "torch",
            _loader("functional", "layer_norm"),
            description="F.layer_norm over the last dimension",
        ),
        KernelVariant(
            "rms_norm",
            "torch",
            _loader("functional", "rms_norm"),
            description="F.rms_norm over the last dimension",
        ),
        KernelVariant(
            "gelu",
            "torch",
            _loader("functional", "gelu"),
            description='F.gelu(x, approximate="tanh") (GPT-2\'s gelu_new)',
        ),
        KernelVariant("silu", "torch", _loader("functional", "silu"), description="F.silu"),
        KernelVariant(
            "linear",
            "torch",
            _loader("functional", "linear"),
            description="F.linear: x @ weight.T + bias",
        ),
        KernelVariant(
            "chunked_cross_entropy",
            "torch",
            _loader("cross_entropy", "chunked_cross_entropy"),
            description="token-chunked logits, log-softmax, loss sum and both gradients in "
            "float32; one chunk of logits at a time; ignores target -100",
        ),
        KernelVariant(
            "adamw",
            "torch",
            _loader("adamw", "adamw_fused"),
            priority=0,
            description="torch._fused_adamw_ when param, grad and states share a dtype; "
            "else the float32 reference",
        ),
        KernelVariant(
            "adamw",
            "torch-reference",
            _loader("adamw", "adamw_reference"),
            priority=-10,
            description="plain tensor ops, float32 math over any storage dtypes "
            "(bfloat16 states of a float32 param)",
        ),
    ]
