"""The layers of a GPT-2 chain and the parameters of each, with exact shapes.

Names follow HF's ``GPT2LMHeadModel`` (``ln_1``, ``attn.c_attn``, ``mlp.c_fc``, ...), but
every projection weight is stored ``(out, in)``, the layout of the ``linear`` op (HF's
``Conv1D`` stores ``(in, out)``; the parts' key rules transpose). The embedding's and the
blocks' parameters are their parts' (``model.py``); norm parameters and biases take no
weight decay.
"""

from __future__ import annotations

from math import prod

from dataflow_training.kit import LayerSpec, TensorSpec

from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.model import GPT2Block, GPT2Embed

EMBED = "emb"
HEAD = "head"


def head_params(config: GPT2Config) -> tuple[TensorSpec, ...]:
    """The final norm; the output projection is the embed layer's ``wte`` (tied)."""
    return (
        TensorSpec("ln_f.weight", (config.n_embd,), decay=False),
        TensorSpec("ln_f.bias", (config.n_embd,), decay=False),
    )


def layer_specs(config: GPT2Config) -> list[LayerSpec]:
    """``emb``, blocks ``"0"`` .. ``str(n_layer - 1)``, ``head``: the chain's order. The
    head's output projection is tied to the embedding's ``wte``."""
    block = GPT2Block()
    return [
        LayerSpec.single(EMBED, "embed", GPT2Embed().params(config)),
        *(block.layer(config, str(layer), "block") for layer in range(config.n_layer)),
        LayerSpec.single(HEAD, "head", head_params(config), tied={"wte": f"{EMBED}.wte"}),
    ]


def parameter_count(config: GPT2Config) -> int:
    """Number of parameters (``wte``'s real vocabulary rows, not its padding), the tied
    output projection counted once (as ``emb.wte``)."""
    return sum(prod(param.state_shape) for layer in layer_specs(config) for param in layer.params)
