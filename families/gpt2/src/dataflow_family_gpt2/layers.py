"""The layers of a GPT-2 chain and the parameters of each, with exact shapes.

Names follow HF's ``GPT2LMHeadModel`` (``ln_1``, ``attn.c_attn``, ``mlp.c_fc``, ...), but
every projection weight is stored ``(out, in)``, the layout of the ``linear`` op (HF's
``Conv1D`` stores ``(in, out)``; ``checkpoint.py`` transposes). Pure Python: no torch.
"""

from __future__ import annotations

from math import prod

from dataflow_training.kit import LayerSpec, TensorSpec

from dataflow_family_gpt2.config import GPT2Config

EMBED = "emb"
HEAD = "head"


def embed_params(config: GPT2Config) -> tuple[TensorSpec, ...]:
    """Token embedding ``wte`` (also the tied output projection) and positions ``wpe``."""
    return (
        TensorSpec("wte", (config.vocab_size, config.n_embd)),
        TensorSpec("wpe", (config.n_positions, config.n_embd)),
    )


def block_params(config: GPT2Config) -> tuple[TensorSpec, ...]:
    """One transformer block. Norm parameters and biases take no weight decay."""
    n, inner = config.n_embd, config.n_inner
    return (
        TensorSpec("ln_1.weight", (n,), decay=False),
        TensorSpec("ln_1.bias", (n,), decay=False),
        TensorSpec("attn.c_attn.weight", (3 * n, n)),
        TensorSpec("attn.c_attn.bias", (3 * n,), decay=False),
        TensorSpec("attn.c_proj.weight", (n, n)),
        TensorSpec("attn.c_proj.bias", (n,), decay=False),
        TensorSpec("ln_2.weight", (n,), decay=False),
        TensorSpec("ln_2.bias", (n,), decay=False),
        TensorSpec("mlp.c_fc.weight", (inner, n)),
        TensorSpec("mlp.c_fc.bias", (inner,), decay=False),
        TensorSpec("mlp.c_proj.weight", (n, inner)),
        TensorSpec("mlp.c_proj.bias", (n,), decay=False),
    )


def head_params(config: GPT2Config) -> tuple[TensorSpec, ...]:
    """The final norm; the output projection is the embed layer's ``wte`` (tied)."""
    return (
        TensorSpec("ln_f.weight", (config.n_embd,), decay=False),
        TensorSpec("ln_f.bias", (config.n_embd,), decay=False),
    )


def layer_specs(config: GPT2Config) -> list[LayerSpec]:
    """``emb``, blocks ``"0"`` .. ``str(n_layer - 1)``, ``head``: the chain's order. The
    head's output projection is tied to the embedding's ``wte``."""
    return [
        LayerSpec.single(EMBED, "embed", embed_params(config)),
        *(
            LayerSpec.single(str(layer), "block", block_params(config))
            for layer in range(config.n_layer)
        ),
        LayerSpec.single(HEAD, "head", head_params(config), tied={"wte": f"{EMBED}.wte"}),
    ]


def parameter_count(config: GPT2Config) -> int:
    """Number of parameters, the tied output projection counted once (as ``emb.wte``)."""
    return sum(prod(param.shape) for layer in layer_specs(config) for param in layer.params)
