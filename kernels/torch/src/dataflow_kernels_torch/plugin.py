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

The explicit forward/backward ops (``attention_fwd``/``attention_bwd``,
``layer_norm_fwd``/``_bwd``, ``rms_norm_fwd``/``_bwd``, ``gelu_bwd``, ``swiglu_fwd``/``_bwd``,
``adamw_multi``, ``adamw_compensated_multi``) each have a ``torch`` variant (priority 0: aten's fused kernels called
directly, no autograd) and a ``reference`` variant (priority -10: the formulas, the truth
the tests compare against); where triton is installed, ``triton`` variants (priority 10,
CUDA only) replace the torch ones for SwiGLU, for mixed-dtype AdamW and for the
compensated AdamW.

- ``attention_bwd/torch`` is False for the reason ``attention/torch`` is: it calls the
  flash or memory-efficient backward directly, which accumulate dq with atomics.
  ``attention_fwd/torch`` is True: the flash and memory-efficient forwards write each
  output row from one thread block (flash's split-KV mode combines the splits in a
  second kernel, without atomics).
- ``attention_bwd/reference`` is True: matmuls and elementwise ops only.
- The norms' backwards reduce dweight/dbias in fixed-order kernels (no atomics), as the
  existing ``layer_norm``/``rms_norm`` flags say; the elementwise, cross-entropy and
  AdamW ops are True for the reasons above. The Triton kernels write each element from
  one program and reduce nothing.
- ``rows_add_masked`` (an MoE shard's window rows summed into their tokens, ``rows.py``)
  is False for its ``torch`` and ``triton`` variants: both add with atomics on CUDA.
  Its ``reference`` sums on the CPU in float64 (True); ``rows_put_masked`` writes each
  row once, ``rows_gather_masked`` copies and ``swiglu_rows_bwd`` reduces each row in
  one program, in order (True).

Each claim of True is checked on CUDA by ``tests/test_determinism.py`` (bitwise-equal
repeated runs).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any

from dataflow import KernelVariant, hookimpl

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
            description="token-chunked: 16-bit matmuls with float32 logits, softmax and "
            "loss, float32 d_weight accumulation (float32/float64 inputs: the reference); "
            "one chunk of logits at a time; ignores target -100",
        ),
        KernelVariant(
            "chunked_cross_entropy",
            "reference",
            _loader("cross_entropy", "chunked_cross_entropy_reference"),
            priority=-10,
            description="token-chunked, every matmul and the softmax in float32 (float64 "
            "for float64 inputs) from a float32 copy of weight",
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
        *_explicit_variants(),
        *(_triton_variants() if importlib.util.find_spec("triton") is not None else []),
        *_cudnn_variants(),
        *_grouped_variants(),
        *_rows_variants(),
        *_delta_rule_variants(),
        *_sparse_attention_variants(),
    ]


#: (op, module, fast function, reference function, torch variant deterministic, what the
#: torch variant runs) for the explicit forward/backward ops.
_EXPLICIT = (
    ("attention_fwd", "attention", "attention_fwd", "attention_fwd_reference", True,
     "aten flash attention (CUDA 16-bit), memory-efficient attention (CUDA float32) or the "
     "CPU flash kernel; returns (out, lse)"),
    ("attention_bwd", "attention", "attention_bwd", "attention_bwd_reference", False,
     "the matching aten flash / memory-efficient / CPU flash backward from (out, lse); "
     "atomics in the CUDA backwards"),
    ("layer_norm_fwd", "norms", "layer_norm_fwd", "layer_norm_fwd_reference", True,
     "aten.native_layer_norm; returns (y, mean, rstd)"),
    ("layer_norm_bwd", "norms", "layer_norm_bwd", "layer_norm_bwd_reference", True,
     "aten.native_layer_norm_backward from (mean, rstd)"),
    ("rms_norm_fwd", "norms", "rms_norm_fwd", "rms_norm_fwd_reference", True,
     "aten._fused_rms_norm; returns (y, rstd)"),
    ("rms_norm_bwd", "norms", "rms_norm_bwd", "rms_norm_bwd_reference", True,
     "aten._fused_rms_norm_backward where the build has it (CUDA), else the formulas"),
    ("gelu_bwd", "elementwise", "gelu_bwd", "gelu_bwd_reference", True,
     'aten.gelu_backward(approximate="tanh")'),
    ("swiglu_fwd", "elementwise", "swiglu_fwd", "swiglu_fwd_reference", True,
     "aten.silu(gate) * up"),
    ("swiglu_bwd", "elementwise", "swiglu_bwd", "swiglu_bwd_reference", True,
     "aten.silu_backward(dy * up, gate) and dy * silu(gate)"),
    ("adamw_multi", "adamw_multi", "adamw_multi", "adamw_multi_reference", True,
     "torch._fused_adamw_ per group of one dtype; mixed dtypes over float32 working copies"),
    ("adamw_compensated_multi", "adamw_multi", "adamw_compensated_multi",
     "adamw_compensated_multi_reference", True,
     "float32 masters param + compensation, adamw_multi over them, rounded back into param "
     "and compensation"),
)  # fmt: skip


def _explicit_variants() -> list[KernelVariant]:
    variants = []
    for op, module, fast, reference, deterministic, what in _EXPLICIT:
        variants.append(
            KernelVariant(
                op,
                "torch",
                _loader(module, fast),
                deterministic=deterministic,
                priority=0,
                description=what,
            )
        )
        variants.append(
            KernelVariant(
                op,
                "reference",
                _loader(module, reference),
                priority=-10,
                description="the formulas in float32 (float64 for float64 inputs), "
                "plain tensor ops, any device",
            )
        )
    return variants


#: (op, function in triton_kernels, description) of the Triton variants.
_TRITON = (
    ("adamw_multi", "adamw_multi_triton",
     "one Triton pass per mixed-dtype tensor (bf16 params and grads, float32 states): reads "
     "p, g, m, v once, writes p, m, v once; other tensors as adamw_multi/torch"),
    ("adamw_compensated_multi", "adamw_compensated_multi_triton",
     "one Triton pass per tensor: reads p, g, m, v, c once, writes p, m, v, c once (18 bytes "
     "per bf16 parameter of --precision bf16); other tensors as adamw_compensated_multi/torch"),
    ("swiglu_fwd", "swiglu_fwd_triton", "silu(gate) * up in one Triton pass, float32 math"),
    ("swiglu_bwd", "swiglu_bwd_triton", "(dgate, dup) in one Triton pass, float32 math"),
    ("rows_add_masked", "rows_add_masked_triton",
     "an MoE shard's valid window rows alone loaded, scaled and added into their tokens "
     "(float32 atomics: not deterministic); float64 or CPU as the torch variant"),
    ("rows_put_masked", "rows_put_masked_triton",
     "the valid window rows alone read and written; else as the torch variant"),
    ("rows_gather_masked", "rows_gather_masked_triton",
     "the valid window rows alone gathered (the others left unwritten); else as the "
     "torch variant"),
    ("swiglu_rows_bwd", "swiglu_rows_bwd_triton",
     "the valid window rows alone, in one pass (float32 math, each output rounded once); "
     "else as the torch variant"),
    ("chunked_cross_entropy", "triton_ce.chunked_cross_entropy_triton",
     "16-bit: the vocabulary padded to a multiple of 128 for the tensor cores, bf16 logits, "
     "softmax, loss and d_logits in one Triton pass per row; else as the torch variant"),
)  # fmt: skip


#: cuDNN's fused attention pair: one priority for both, so they are chosen together.
#: Preferred where it applies (16-bit CUDA; elsewhere it calls the torch pair). On an
#: H200 (torch 2.11, 2026-12-02), inside compiled tasks replayed from a CUDA graph,
#: attention took 4.34 ms per 16K tokens of GPT-2 124M (flash: 6.16) and 68.6 ms of
#: l3_1b at seq 4096 (flash: 97.9); stock torch.compile's SDPA picks cuDNN there too
#: (benchmarks/kernel_breakdown.py, results/kernel_breakdown/*_after.md). An earlier
#: measurement against it (session 3) timed eager tasks launched from the host, where
#: launch overhead, not the kernels, decided.
CUDNN_ATTENTION_PRIORITY = 5


def _cudnn_variants() -> list[KernelVariant]:
    return [
        KernelVariant(
            op,
            "cudnn",
            _loader("attention_cudnn", f"{op}_cudnn"),
            devices=("cuda",),
            deterministic=op == "attention_fwd",
            priority=CUDNN_ATTENTION_PRIORITY,
            description=f"cuDNN fused attention ({'forward, returns (out, lse)' if op == 'attention_fwd' else 'backward from (out, lse)'}); "
            "16-bit CUDA, head_dim <= 128, else the torch pair",
        )
        for op in ("attention_fwd", "attention_bwd")
    ]


def _grouped_variants() -> list[KernelVariant]:
    """The MoE grouped GEMMs (``grouped.py``): ``torch`` calls ``torch._grouped_mm`` for
    bfloat16 CUDA inputs where this torch has it (2.8 and later), the expert loop
    otherwise; ``reference`` is the loop."""
    return [
        variant
        for op in ("grouped_mm", "grouped_mm_wgrad")
        for variant in (
            KernelVariant(
                op,
                "torch",
                _loader("grouped", f"{op}_cuda"),
                priority=0,
                description="torch._grouped_mm, one launch for all experts (bfloat16 CUDA, "
                "widths multiples of 16); else one matmul per expert",
            ),
            KernelVariant(
                op,
                "reference",
                _loader("grouped", f"{op}_reference"),
                priority=-10,
                description="one matmul per expert over its rows (offsets read on the host)",
            ),
        )
    ]


#: the masked row ops whose torch variant adds with atomics on CUDA (``rows.py``)
_ATOMIC_ROWS = ("rows_add_masked",)


def _rows_variants() -> list[KernelVariant]:
    """The masked row writes of an MoE shard's window (``rows.py``): ``torch`` over every
    row of the window with no host read (capturable); ``reference`` the valid rows picked
    out on the host and summed in float64."""
    return [
        variant
        for op in ("rows_add_masked", "rows_put_masked", "rows_gather_masked", "swiglu_rows_bwd")
        for variant in (
            KernelVariant(
                op,
                "torch",
                _loader("rows", op),
                deterministic=op not in _ATOMIC_ROWS,
                priority=0,
                description="every window row: cast, scaled and index_add_-ed (the invalid "
                "into a dropped row), rewritten with what it held where not valid, "
                "gathered, or their SwiGLU backward by the torch elementwise ops",
            ),
            KernelVariant(
                op,
                "reference",
                _loader("rows", f"{op}_reference"),
                priority=-10,
                description="the valid rows picked out on the host, in float64",
            ),
        )
    ]


def _sparse_attention_variants() -> list[KernelVariant]:
    """DeepSeek Sparse Attention over the indexer's selection (``sparse_attention.py``):
    ``torch``, each query's selected keys gathered, (seq, K) scores, any device;
    ``reference``, the whole (seq, seq) scores masked to the selection. The gather's
    backward sums the keys' gradients with ``index_put_(accumulate=True)``, atomics on
    CUDA: not deterministic there."""
    return [
        variant
        for op in ("sparse_attention_fwd", "sparse_attention_bwd", "sparse_attention_probs")
        for variant in (
            KernelVariant(
                op,
                "torch",
                _loader("sparse_attention", op),
                deterministic=op != "sparse_attention_bwd",
                priority=0,
                description="each query's K selected keys and values gathered: (seq, K) "
                "scores, float32 softmax",
            ),
            KernelVariant(
                op,
                "reference",
                _loader("sparse_attention", f"{op}_reference"),
                priority=-10,
                description="the whole (seq, seq) scores, -inf outside the selection and causality",
            ),
        )
    ]


#: what ``fla``'s gated delta rule imports: its variant is registered only where all are
#: installed (the device gets them as wheels in .whl/, installed without dependencies)
_FLA_NEEDS = ("fla", "einops", "triton")
#: the Tritons fla 0.6 refuses to run its gated backward with on Hopper (its issue #640:
#: wrong results in ``chunk_bwd_dqkwg``) unless tilelang is installed: it raises
#: RuntimeError at the first backward (seen on the device's H100, session 30)
_FLA_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def _release(version: str) -> tuple[int, ...]:
    """``3.5.1+git...`` -> (3, 5, 1)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _fla_runs() -> bool:
    """fla and what it imports installed, and no Triton fla refuses (``_FLA_BAD_TRITON``;
    judged without asking which GPU this is, so a non-Hopper GPU with such a Triton keeps
    the torch variant too)."""
    if not all(importlib.util.find_spec(name) for name in _FLA_NEEDS):
        return False
    if importlib.util.find_spec("tilelang"):
        return True
    low, high = _FLA_BAD_TRITON
    return not low <= _release(importlib.metadata.version("triton")) < high


def _delta_rule_variants() -> list[KernelVariant]:
    """The gated delta rule (``delta_rule.py``; Gated DeltaNet's linear attention):
    ``torch``, pure torch in 64-token chunks, any device; ``reference``, the recurrence
    token by token with its backward by hand; ``fla``, flash-linear-attention's Triton
    kernels, CUDA only and registered only where ``fla`` and what it imports are
    installed and it runs with the installed Triton (``_fla_runs``; a device without them
    keeps the torch variant)."""
    variants = []
    for op in ("gated_delta_rule_fwd", "gated_delta_rule_bwd"):
        variants += [
            KernelVariant(
                op,
                "torch",
                _loader("delta_rule", op),
                priority=0,
                description="pure torch, 64-token chunks (a triangular solve per chunk), "
                "float32 math (float64 for float64 inputs); the backward re-derives each "
                "chunk's state and differentiates one chunk at a time",
            ),
            KernelVariant(
                op,
                "reference",
                _loader("delta_rule", f"{op}_reference"),
                priority=-10,
                description="the recurrence token by token, its backward a reverse scan "
                "by hand (every token's state kept)",
            ),
        ]
        if _fla_runs():
            variants.append(
                KernelVariant(
                    op,
                    "fla",
                    _loader("delta_rule", f"{op}_fla"),
                    devices=("cuda",),
                    deterministic=False,
                    priority=10,
                    description="flash-linear-attention's chunked Triton kernels "
                    "(chunk_gated_delta_rule's forward; its backward from re-derived "
                    "chunk sums and WY matrix)",
                )
            )
    return variants


def _triton_variants() -> list[KernelVariant]:
    """Registered only where triton is installed; CUDA only, preferred there."""
    return [
        KernelVariant(
            op,
            "triton",
            _loader(*function.rsplit(".", 1))
            if "." in function
            else _loader("triton_kernels", function),
            devices=("cuda",),
            deterministic=op not in _ATOMIC_ROWS,
            priority=10,
            description=description,
        )
        for op, function, description in _TRITON
    ]
