"""HF GPT-2 checkpoints (safetensors + config.json) in and out.

HF's ``GPT2LMHeadModel`` stores its projections as ``Conv1D`` weights of shape (in, out);
the family stores them (out, in), the layout of the ``linear`` op, so import and export
transpose ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` weights. The
output projection ``lm_head.weight`` is the token embedding (tied): it is not written, and
when a checkpoint holds it, it must equal ``wte``.

Import reads both layouts found in the wild: ``save_pretrained`` names
(``transformer.h.0.ln_1.weight``) and the original hub files' (``h.0.ln_1.weight``, with
the old ``attn.bias`` / ``attn.masked_bias`` mask buffers, which are skipped), in one file
(``model.safetensors``) or sharded (``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import EMBED, HEAD, layer_specs

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"

#: Block parameters HF stores as Conv1D weights, (in, out).
CONV1D_WEIGHTS = frozenset(
    {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
)
_PREFIX = "transformer."
_MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

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


class CheckpointError(ValueError):
    """A checkpoint this family cannot read or write; the message names the file and the
    tensor or field at fault."""


def hf_name(key: str) -> str:
    """The HF ``GPT2LMHeadModel`` name of a family state key (``0.ln_1.weight`` ->
    ``transformer.h.0.ln_1.weight``)."""
    layer, _, param = key.partition(".")
    if layer == EMBED:
        return f"{_PREFIX}{param}.weight"
    if layer == HEAD:
        return f"{_PREFIX}{param}"
    return f"{_PREFIX}h.{layer}.{param}"


def _expected(config: GPT2Config) -> Iterator[tuple[str, str, tuple[int, ...], bool]]:
    """(family key, HF name, family shape, transposed?) of every tensor of ``config``."""
    for layer in layer_specs(config):
        for param in layer.params:
            key = f"{layer.name}.{param.name}"
            yield key, hf_name(key), param.shape, param.name in CONV1D_WEIGHTS


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


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SAFETENSORS
    if not single.exists():
        present = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise CheckpointError(
            f"{folder}: no {SAFETENSORS} or {SAFETENSORS_INDEX} (found: {present}); only "
            "safetensors checkpoints are read"
        )
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def import_hf(
    path: str | Path, *, dtype: torch.dtype | None = None
) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """Read an HF GPT-2 checkpoint folder (or its ``.safetensors`` file, ``config.json``
    beside it) -> (config, state keyed as the reference model's ``state_dict()``).

    Tensors keep the checkpoint's dtype unless ``dtype`` is given. A missing, mis-shaped or
    unexpected tensor is an error naming it and its file."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config_path = folder / CONFIG
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG} beside the weights")
    config = config_from_hf(json.loads(config_path.read_text()), str(config_path))
    files = _tensor_files(folder) if not path.is_file() else _single_file(path)
    # Both naming schemes: with or without the "transformer." prefix.
    stored = {name.removeprefix(_PREFIX): name for name in files}

    state: dict[str, torch.Tensor] = {}
    for key, name, shape, transposed in _expected(config):
        short = name.removeprefix(_PREFIX)
        if short not in stored:
            where = ", ".join(sorted({str(file) for file in files.values()}))
            raise CheckpointError(f"{where}: tensor {name!r} is missing (gpt2 key {key!r})")
        name = stored.pop(short)
        tensor = _read(files[name], name)
        hf_shape = shape[::-1] if transposed else shape
        if tuple(tensor.shape) != hf_shape:
            raise CheckpointError(
                f"{files[name]}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{hf_shape} for {config}"
            )
        tensor = tensor.t().contiguous() if transposed else tensor
        state[key] = tensor if dtype is None else tensor.to(dtype)

    lm_head = stored.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(
        _read(files[lm_head], lm_head).to(state[f"{EMBED}.wte"].dtype), state[f"{EMBED}.wte"]
    ):
        raise CheckpointError(
            f"{files[lm_head]}: tensor 'lm_head.weight' differs from 'wte.weight', but the "
            "gpt2 family ties them"
        )
    unexpected = sorted(name for short, name in stored.items() if not _MASK_BUFFER.match(short))
    if unexpected:
        where = ", ".join(sorted({str(files[name]) for name in unexpected}))
        raise CheckpointError(
            f"{where}: unexpected tensor(s) {', '.join(map(repr, unexpected[:8]))}"
            f"{' ...' if len(unexpected) > 8 else ''} for {config}"
        )
    return config, state


def _single_file(path: Path) -> dict[str, Path]:
    with safe_open(path, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), path)


def _read(file: Path, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as handle:
        return handle.get_tensor(name)


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


def export_hf(config: GPT2Config, state: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write ``state`` (keyed as the reference model's ``state_dict()``) as an HF GPT-2
    checkpoint folder: ``config.json`` and ``model.safetensors``, loadable by
    ``transformers.GPT2LMHeadModel.from_pretrained``. A missing or mis-shaped key is an
    error naming it."""
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    expected = list(_expected(config))
    for key, name, shape, transposed in expected:
        if key not in state:
            raise CheckpointError(f"export to {folder}: state has no tensor {key!r}")
        tensor = state[key].detach().cpu()
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"export to {folder}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                f"expected {shape} for {config}"
            )
        tensors[name] = (tensor.t() if transposed else tensor).contiguous()
    extra = sorted(set(state) - {key for key, _, _, _ in expected})
    if extra:
        raise CheckpointError(
            f"export to {folder}: state has tensor(s) {', '.join(map(repr, extra))} that "
            f"{config} does not have"
        )
    folder.mkdir(parents=True, exist_ok=True)
    dtype = tensors[hf_name(f"{EMBED}.wte")].dtype
    (folder / CONFIG).write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
    save_file(tensors, str(folder / SAFETENSORS), metadata={"format": "pt"})
