"""What a part of a block declares: the contract between ``block.Block`` and its parts.

A block (``block.py``) is composed of parts, each a stdlib frozen dataclass chosen by the
config's architecture (``decoder.Decoder``), never a flag threaded through the block:

- a **norm** (``norms.Norm``: its kind, RMS or layer, and the config field of epsilon);
  where the norms sit is the block's own layout (``Block``: pre-norm residual), and
  their names too (``Block.norm_names``);
- an **attention** (``attention.SelfAttention``: causal grouped-query attention, with its
  own parts ``positions``, ``rotary.Rope`` with partial rotation, ``qk_norm``,
  ``attention.QKNorm``, and a sliding ``window``; ``fused_attention.FusedQKVAttention``:
  GPT-2's, one fused projection with biases; ``linear_attention.GatedDeltaNet``: Qwen
  3.5's linear attention, a recurrence instead of softmax);
- an **FFN** (``mlp.SwiGLUFFN`` and ``mlp.GELUFFN``, dense; ``moe.RoutedExperts``, routed
  experts).

Learned positions are the embedding's part (``decoder_math.LearnedPositions``), not a
block's.

Each part brings, for the config it is given:

- its **parameters**: ``params(config)``, ``TensorSpec`` s named as HF names them inside a
  layer (``self_attn.q_proj.weight``), with exact shapes; an FFN may add parameter groups
  of its own (``groups``: the experts) and persistent ``aux`` state (``aux_scope``:
  ``"layer"``, each layer's own, or ``"model"``, one object its blocks share, named by
  the part's ``aux_key``);
- its **HF keys**: ``hf_rules(config, prefix)``, the key rules of its parameters under a
  layer's HF prefix (``model.layers.{layer}``: as they are, transposed from HF's
  ``Conv1D`` (``conv1d``), or stacked per expert);
- its **math** over ``env.ops`` (``ops``: the op names it calls), forward and backward,
  and what forward **saves** for backward (``saved(config, batch, seq_len)``: exact
  shapes, the ``A_`` object's contents) and decides once (an FFN's ``aux_temp``);
- its **cost** (an attention's ``flops``; an FFN's ``cost``, an ``FfnCost``), from which
  the block's ``LayerCost`` is summed;
- its **reference**: ``reference(config)``, the plain-torch module of
  ``decoder_reference`` (or ``moe_reference``) with this part's settings, so the truth
  is composed the same way and shares no math with it; ``module``, the name the block
  gives that module (HF's: ``self_attn``, ``attn``, ``mlp``), the prefix of the part's
  parameter names.

The next parts (MLA, sparse attention with an indexer) are new classes with these members; a block that lays its norms out otherwise (post-norm)
is a new block class, not a flag, and so is one that counts its bytes otherwise (GPT-2's
``GPT2Block`` keeps its family's coarser count: a subclass with its own ``cost``).
"""

from __future__ import annotations

import dataclasses
from math import prod
from typing import Any

from dataflow_training.step.family import TensorSpec, Work


@dataclasses.dataclass(frozen=True)
class FfnCost:
    """An FFN part's share of its block's work for one round (``batch`` x ``seq_len``
    tokens): ``matmul``, its forward's matmul FLOPs; ``moved``, activation values per
    token it moves beyond reading its input and writing and reading back its saved
    tensors (an MoE's rows gathered and combined); ``backward``, FLOPs its backward adds
    beyond twice the forward's matmuls (an MoE's router logits made again);
    ``not_recomputed``, forward FLOPs a recompute skips (it stops at the saved tensors);
    ``rederive``, the work of making its saved tensors again from the block's residual
    stream (the block's ``mlp`` partial save)."""

    matmul: float
    rederive: Work
    not_recomputed: float
    moved: int = 0
    backward: float = 0


def as_is(params: tuple[TensorSpec, ...], prefix: str) -> list[Any]:
    """HF key rules storing each parameter under its own name after ``prefix``
    (``model.layers.{layer}``): ``{layer}.<name>`` <-> ``<prefix>.<name>``."""
    # kit.hf needs torch: a part's key rules are built when a checkpoint is read or written
    from dataflow_training.kit.hf import KeyRule

    return [KeyRule(f"{{layer}}.{p.name}", f"{prefix}.{p.name}") for p in params]


def conv1d(params: tuple[TensorSpec, ...], prefix: str) -> list[Any]:
    """HF key rules of parameters HF keeps in ``Conv1D`` modules (GPT-2's), each under its
    own name after ``prefix``: the weights transposed (``Conv1D`` stores ``(in, out)``, a
    part ``(out, in)``), the biases as they are."""
    # kit.hf needs torch: a part's key rules are built when a checkpoint is read or written
    from dataflow_training.kit.hf import IDENTITY, TRANSPOSE, KeyRule

    return [
        KeyRule(
            f"{{layer}}.{p.name}",
            f"{prefix}.{p.name}",
            TRANSPOSE if len(p.shape) == 2 else IDENTITY,
        )
        for p in params
    ]


def values_per_token(saved: tuple[TensorSpec, ...]) -> int:
    """Activation-dtype values a part saves per token: its ``saved(config, 1, 1)`` summed
    over the tensors of the policy's dtype (a float32 logsumexp is not counted)."""
    return sum(prod(spec.shape) for spec in saved if spec.dtype == "policy")


def ops_of(*parts: Any) -> tuple[str, ...]:
    """The op names of ``parts``, each once, in order."""
    return tuple(dict.fromkeys(op for part in parts for op in part.ops))
