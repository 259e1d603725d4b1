"""HF checkpoints of a decoder (``decoder.py``): the key table and the ``config.json`` fields
that ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` and their MoE kin share.

Tensor names are HF's with the layer moved: ``{layer}.{param}`` <-> ``model.layers.{layer}.
{param}`` (each block part declares its rules: as they are, or an MoE's experts stacked),
``emb.embed_tokens.weight`` <-> ``model.embed_tokens.weight``, ``head.norm.weight``
<-> ``model.norm.weight``, ``head.lm_head.weight`` <-> ``lm_head.weight``. HF stores every
projection ``(out, in)``, as the family does, so nothing is transposed. A tied model has
no ``head.lm_head.weight``: a checkpoint's ``lm_head.weight``, where present, must equal
the embedding, and export does not write it.

Rotary settings are read in both spellings found in the wild: ``rope_theta`` with
``rope_scaling`` (the published Llama 3.x and Qwen 3 files, transformers 4) and
``rope_parameters`` (transformers 5); export writes both, so either version loads it.
Sliding windows are read and written in Qwen's fields (``use_sliding_window``,
``sliding_window``, ``max_window_layers``, ``layer_types``: ``window_fields_from_hf``,
``window_fields_to_hf``). The family's own file maps the rest of ``config.json``
(``model_type``, its own checks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dataflow_training.kit.decoder import (
    EMBED,
    EMBED_WEIGHT,
    FINAL_NORM,
    HEAD,
    LAYER_TYPES,
    LM_HEAD,
    DecoderConfig,
    expected_state,
)
from dataflow_training.kit.hf import (
    CONFIG,
    CheckpointError,
    KeyMap,
    KeyRule,
    checkpoint_folder,
    read_config,
    read_state,
    write_config,
    write_state,
)
from dataflow_training.kit.rotary import Llama3Scaling

#: HF defaults of the shared fields, for sizes a config.json leaves out (LlamaConfig's)
HF_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


#: the layer types of attention with or without a window (``window_fields_from_hf``)
WINDOW_LAYER_TYPES = tuple(kind for kind in LAYER_TYPES if kind != "linear_attention")

#: where HF keeps a layer's tensors
LAYER_PREFIX = "model.layers.{layer}"


def block_rules(config: DecoderConfig) -> list[KeyRule]:
    """The key rules every block kind of ``config``'s architecture declares, each once."""
    rules: dict[str, KeyRule] = {}
    for kind, block in config.architecture.blocks.items():
        for rule in block.hf_rules(config, LAYER_PREFIX):
            if rules.setdefault(rule.key, rule) != rule:
                raise ValueError(f"block kind {kind!r} stores {rule.key!r} otherwise: {rule}")
    return list(rules.values())


def key_map(family: str, config: DecoderConfig) -> KeyMap:
    """The family key <-> HF tensor name table of ``config`` (tied or not; its blocks'
    parts' rules)."""
    tied = "lm_head.weight" if config.tie_word_embeddings else ()
    return KeyMap(
        family,
        rules=[
            KeyRule(f"{EMBED}.{EMBED_WEIGHT}", "model.embed_tokens.weight", tied=tied),
            *block_rules(config),
            KeyRule(f"{HEAD}.{FINAL_NORM}", "model.norm.weight"),
            KeyRule(f"{HEAD}.{LM_HEAD}", "lm_head.weight"),
        ],
        # the rotary frequencies older transformers versions saved as buffers
        skip=[r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"],
    )


# -- config.json -----------------------------------------------------------------------


def _refuser(hf: Mapping[str, Any], source: str) -> Callable[[str, str], CheckpointError]:
    def refuse(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field} = {hf.get(field)!r}: {why}")

    return refuse


def _rope(hf: Mapping[str, Any], source: str, default_theta: float) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from either spelling (see the module docstring)."""
    refuse = _refuser(hf, source)
    parameters = hf.get("rope_parameters")
    if parameters is not None:
        field = "rope_parameters"
        if not isinstance(parameters, Mapping) or "rope_type" not in parameters:
            raise refuse(field, "expected one object with a 'rope_type'")
        scaling, theta = parameters, parameters.get("rope_theta", default_theta)
    else:
        field, scaling = "rope_scaling", hf.get("rope_scaling") or {"rope_type": "default"}
        theta = hf.get("rope_theta", default_theta)
        if not isinstance(scaling, Mapping):
            raise refuse(field, "expected an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind != "llama3":
        raise refuse(field, f"rope type {kind!r} is not implemented (only 'default', 'llama3')")
    try:
        llama3 = Llama3Scaling(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position=scaling["original_max_position_embeddings"],
        )
    except KeyError as missing:
        raise refuse(field, f"a 'llama3' rope type needs {missing}") from None
    return {"rope_theta": theta, "rope_scaling": llama3}


def fields_from_hf(
    hf: Mapping[str, Any],
    source: str,
    *,
    model_type: str,
    defaults: Mapping[str, Any] = HF_DEFAULTS,
) -> dict[str, Any]:
    """The ``DecoderConfig`` fields of an HF ``config.json`` of ``model_type``. Settings the decoder does not implement (another activation, biases,
    another rope type) are errors naming the field and ``source``."""
    refuse = _refuser(hf, source)
    if hf.get("model_type", model_type) != model_type:
        raise refuse("model_type", f"not a {model_type} checkpoint")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "the decoder's MLP is SwiGLU with silu")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias, False):
            raise refuse(bias, "the decoder's projections have no biases")
    names = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    # a default only where the file has no value (an MoE family's defaults have no dense width)
    fields = {name: hf[name] if name in hf else defaults[name] for name in names}
    heads = fields["num_attention_heads"]
    fields["num_key_value_heads"] = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    if head_dim is None and isinstance(heads, int) and heads > 0:
        head_dim = fields["hidden_size"] // heads
    fields["head_dim"] = head_dim
    return fields | _rope(hf, source, defaults["rope_theta"])


def fields_to_hf(config: DecoderConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The shared part of the ``config.json`` of ``config`` (dropout 0: it trains without)."""
    rope: dict[str, Any] = {"rope_type": "default"}
    scaling = config.rope_scaling
    if scaling is not None:
        rope = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        }
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if scaling is None else rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "dtype": str(dtype).removeprefix("torch."),
    }


def check_full_attention(hf: Mapping[str, Any], source: str, family: str) -> None:
    """Refuse a ``config.json`` whose ``layer_types`` name other than full attention (a
    sliding window), naming the field and ``source``."""
    others = sorted({kind for kind in hf.get("layer_types") or [] if kind != "full_attention"})
    if others:
        raise CheckpointError(
            f"{source}: layer_types has {others}: the {family} family implements only "
            "'full_attention' layers"
        )


def full_attention_fields(layers: int) -> dict[str, Any]:
    """The ``config.json`` fields (Qwen's) that say every layer attends to all tokens."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
    }


def window_fields_from_hf(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a config whose layers are full or
    sliding-window attention, from Qwen's ``config.json`` fields, as transformers reads
    them: the window is ``sliding_window`` where ``use_sliding_window`` (else none); the
    layers are ``layer_types``, or where a file has none, sliding from layer
    ``max_window_layers`` on (default 28) when there is a window. Every layer full
    attention reads as ``layer_types`` None."""
    refuse = _refuser(hf, source)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    layers = hf.get("num_hidden_layers", 0)
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    elif not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise refuse("layer_types", "expected a list of layer type names")
    unknown = sorted(set(types) - set(WINDOW_LAYER_TYPES))
    if unknown:
        why = f"{unknown} are not implemented (only {', '.join(WINDOW_LAYER_TYPES)})"
        raise refuse("layer_types", why)
    if "sliding_attention" in types and window is None:
        why = "sliding_attention layers need use_sliding_window and a sliding_window"
        raise refuse("layer_types", why)
    full = all(kind == "full_attention" for kind in types)
    return {"sliding_window": window, "layer_types": None if full else list(types)}


def window_fields_to_hf(config: Any) -> dict[str, Any]:
    """The ``config.json`` fields (Qwen's) of ``config``'s window and layer types:
    ``max_window_layers`` the full layers before the first sliding one."""
    layers = config.num_hidden_layers
    types = list(config.layer_types or ["full_attention"] * layers)
    first = next((i for i, kind in enumerate(types) if kind != "full_attention"), layers)
    return {
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "max_window_layers": first,
        "layer_types": types,
    }


# -- import and export -----------------------------------------------------------------


def import_decoder(
    path: str | Path,
    family: str,
    config_from_hf: Callable[[Mapping[str, Any], str], DecoderConfig],
    *,
    dtype: torch.dtype | None = None,
) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """(config, state keyed as the reference model's ``state_dict()``) of the HF checkpoint
    at ``path`` (its folder, a ``.safetensors`` file or the shards' index; ``config.json``
    beside it). Tensors keep the checkpoint's dtype unless ``dtype`` is given; missing,
    mis-shaped or unexpected tensors are one error naming them all and their files."""
    config = config_from_hf(read_config(path), str(checkpoint_folder(path) / CONFIG))
    state = read_state(path, key_map(family, config), expected_state(config), dtype=dtype)
    return config, state


def export_decoder(
    config: DecoderConfig,
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    family: str,
    hf_config: dict[str, Any],
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``state`` as an HF checkpoint folder: ``config.json`` (``hf_config``) and
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` and their
    ``model.safetensors.index.json``. Missing, extra or mis-shaped keys are one error
    naming them; nothing is written then."""
    write_state(
        path,
        key_map(family, config),
        state,
        expected_state(config),
        max_shard_bytes=max_shard_bytes,
    )
    write_config(path, hf_config)
