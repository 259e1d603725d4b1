"""HF GPT-2 checkpoints (safetensors + config.json) in and out.

HF's ``GPT2LMHeadModel`` stores its projections as ``Conv1D`` weights of shape (in, out);
the family stores them (out, in), the layout of the ``linear`` op, so import and export
transpose ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` weights (the
block's parts say so: their key rules). The output projection ``lm_head.weight`` is the
token embedding (tied): it is not written, and when a checkpoint holds it, it must equal
``wte``.

Import reads both layouts found in the wild: ``save_pretrained`` names
(``transformer.h.0.ln_1.weight``) and the original hub files' (``h.0.ln_1.weight``, with
the old ``attn.bias`` / ``attn.masked_bias`` mask buffers, which are skipped), in one file
(``model.safetensors``) or sharded (``model.safetensors.index.json``).

All of that is the key table ``key_map(config)``; the file I/O and its checks are the
training kit's (``dataflow_training.kit.hf``). This module adds ``config.json`` <->
``GPT2Config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dataflow_training.kit import (
    CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointError,
    KeyMap,
    KeyRule,
    checkpoint_folder,
    read_config,
    read_state,
    write_config,
    write_state,
)
from dataflow_training.kit import expected_state as decoder_state

from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import EMBED, HEAD, layer_specs
from dataflow_family_gpt2.model import GPT2Block

__all__ = [
    "CONFIG",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "CheckpointError",
    "config_from_hf",
    "config_to_hf",
    "expected_state",
    "export_hf",
    "import_hf",
    "key_map",
]


def key_map(config: GPT2Config) -> KeyMap:
    """Family state key <-> ``GPT2LMHeadModel`` tensor name: the embedding's, the blocks'
    (their parts' rules under ``transformer.h.{layer}``) and the final norm's."""
    return KeyMap(
        "gpt2",
        rules=[
            KeyRule(f"{EMBED}.wte", "transformer.wte.weight", tied="lm_head.weight"),
            KeyRule(f"{EMBED}.wpe", "transformer.wpe.weight"),
            *GPT2Block().hf_rules(config, "transformer.h.{layer}"),
            KeyRule(f"{HEAD}.ln_f.weight", "transformer.ln_f.weight"),
            KeyRule(f"{HEAD}.ln_f.bias", "transformer.ln_f.bias"),
        ],
        # The causal-mask buffers of old transformers versions, not parameters.
        skip=[r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"],
        # The original hub files name everything but lm_head without the "transformer." prefix.
        aliases=[(r"((h\.\d+|wte|wpe|ln_f)\..+)", r"transformer.\1")],
    )


#: HF GPT2Config defaults, used for sizes a config.json leaves out (as transformers does).
_HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "layer_norm_epsilon": 1e-5,
}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def expected_state(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """State key -> shape of every tensor of ``config`` in the model state (``wte`` its
    real vocabulary's rows), in chain order."""
    return decoder_state(config, layer_specs(config))


# -- Import ----------------------------------------------------------------------------


def config_from_hf(hf_config: Mapping[str, Any], source: str = CONFIG) -> GPT2Config:
    """A ``GPT2Config`` from the contents of an HF GPT-2 ``config.json``; settings this
    family does not implement are errors naming the field and ``source``."""

    def refuse(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field} = {hf_config.get(field)!r}: {why}")

    if hf_config.get("model_type", "gpt2") != "gpt2":
        raise refuse("model_type", "not a GPT-2 checkpoint")
    if hf_config.get("activation_function", "gelu_new") not in _TANH_GELUS:
        raise refuse("activation_function", f"the gpt2 family implements only {_TANH_GELUS}")
    if hf_config.get("scale_attn_by_inverse_layer_idx", False):
        raise refuse("scale_attn_by_inverse_layer_idx", "not implemented by the gpt2 family")
    if not hf_config.get("scale_attn_weights", True):
        raise refuse("scale_attn_weights", "the gpt2 family always scales by 1/sqrt(head_dim)")
    if hf_config.get("add_cross_attention", False):
        raise refuse("add_cross_attention", "cross-attention is not implemented")
    if not hf_config.get("tie_word_embeddings", True):
        raise refuse("tie_word_embeddings", "the gpt2 family ties lm_head to wte")
    sizes = {name: hf_config.get(name, default) for name, default in _HF_DEFAULTS.items()}
    n_inner = hf_config.get("n_inner")
    if n_inner is not None and n_inner != 4 * sizes["n_embd"]:
        raise refuse("n_inner", f"the gpt2 family's MLP is 4 * n_embd = {4 * sizes['n_embd']}")
    try:
        return GPT2Config(**sizes)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: {error}") from error


def import_hf(
    path: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """Read an HF GPT-2 checkpoint folder (or its ``.safetensors`` file, or its index;
    ``config.json`` beside it) -> (config, state keyed as the reference model's
    ``state_dict()``).

    Tensors keep the checkpoint's dtype unless ``dtype`` is given. Missing, mis-shaped or
    unexpected tensors are one error naming them all and their files."""
    config_path = checkpoint_folder(path) / CONFIG
    config = config_from_hf(read_config(path), str(config_path))
    return config, read_state(path, key_map(config), expected_state(config), dtype=dtype)


# -- Export ----------------------------------------------------------------------------


def config_to_hf(config: GPT2Config, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of an HF ``GPT2LMHeadModel`` of ``config`` (dropout 0: the
    family trains without it)."""
    gpt2_eos = 50256 if config.vocab_size > 50256 else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": gpt2_eos,
        "eos_token_id": gpt2_eos,
        "dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(
    config: GPT2Config,
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``state`` (keyed as the reference model's ``state_dict()``) as an HF GPT-2
    checkpoint folder: ``config.json`` and ``model.safetensors`` (or shards of at most
    ``max_shard_bytes`` and their index), loadable by
    ``transformers.GPT2LMHeadModel.from_pretrained``. Missing, extra or mis-shaped keys are
    one error naming them; nothing is written then."""
    write_state(
        path, key_map(config), state, expected_state(config), max_shard_bytes=max_shard_bytes
    )
    dtype = state[f"{EMBED}.wte"].dtype
    write_config(path, config_to_hf(config, dtype))
