"""A LoRA run's adapters out of its checkpoint: PEFT's files (``export --peft``), or merged
into the base (``export --hf --merge``).

PEFT's layout: ``adapter_model.safetensors`` holds, for each adapted linear of HF name
``<module>.weight``, ``base_model.model.<module>.lora_A.weight`` (rank, in) and
``...lora_B.weight`` (out, rank), as dataflow's adapters are (``step.lora``); and
``adapter_config.json`` holds the ``LoraConfig`` fields (``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules``, ``fan_in_fan_out`` where the base stores its
linears transposed, as GPT-2's ``Conv1D``). ``PeftModel.from_pretrained`` puts them on the
transformers model of the base, with the same scale ``lora_alpha / r``.

Merging folds each adapter into its weight, ``W + (alpha / rank) * B A``, in float32, and
drops the adapters: the state of a plain model, as ``export --hf`` writes any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dataflow import fsync_path
from dataflow_training.kit.lora_base import dense_base
from dataflow_training.step.lora import LoraConfig, adapter_names

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class PeftExportError(ValueError):
    """A checkpoint that has no adapters, or a family whose names PEFT cannot take."""


def lora_of(manifest: Mapping[str, Any], checkpoint: str | Path) -> LoraConfig:
    """The ``LoraConfig`` a checkpoint's run trained with (a ``PeftExportError`` if none)."""
    lora = (manifest.get("train") or {}).get("lora")
    if not lora:
        raise PeftExportError(
            f"{checkpoint} is of a run without --lora: it has no adapters (export --hf "
            "writes its whole model)"
        )
    return LoraConfig(
        lora["rank"],
        lora.get("alpha"),
        lora.get("dropout", 0.0),
        lora.get("targets", ()),
        lora.get("base"),
    )


def adapted(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """The state keys of the adapted weights -> their adapters' keys (A, B)."""
    out = {}
    for key in weights:
        if key.endswith(".lora_A.weight"):
            base = key.removesuffix(".lora_A.weight") + ".weight"
            layer, _, name = base.partition(".")
            a, b = adapter_names(name)
            out[base] = (f"{layer}.{a}", f"{layer}.{b}")
    return out


def merged(weights: Mapping[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """``weights`` with each adapter folded into its weight (``W + scale * B A`` in float32,
    stored back in ``W``'s dtype) and the adapters dropped. A base stored quantized or in
    bf16 (``--lora-base``) is first dequantized into the run's dtype (``dense_base``:
    bf16 or float32), so the merged model is in that dtype."""
    weights = dense_base(weights)
    pairs = adapted(weights)
    out = {}
    dropped = {key for pair in pairs.values() for key in pair}
    for key, tensor in weights.items():
        if key in dropped:
            continue
        if key in pairs:
            a, b = (weights[k].float() for k in pairs[key])
            tensor = (tensor.float() + lora.scale * (b @ a)).to(tensor.dtype)
        out[key] = tensor
    return out


def base_state(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without the adapters: the frozen base, dequantized (``dense_base``)."""
    dropped = {key for pair in adapted(weights).values() for key in pair}
    return dense_base({k: v for k, v in weights.items() if k not in dropped})


def write_peft(
    out: str | Path,
    weights: Mapping[str, torch.Tensor],
    lora: LoraConfig,
    family: Any,
    config: Any,
) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` of the adapters in
    ``weights`` into the folder ``out`` (module docstring). Each file is written under a
    temporary name and renamed into place."""
    entries = _hf_entries(family, config, base_state(weights))
    tensors: dict[str, torch.Tensor] = {}
    modules, transposed = set(), set()
    for key, (a, b) in adapted(weights).items():
        entry = entries.get(key)
        if entry is None or len(entry.hf_names) != 1:
            raise PeftExportError(
                f"--peft: the adapted weight {key!r} has no single Hugging Face tensor of "
                "its own; PEFT cannot name its adapters"
            )
        module = entry.hf_names[0].removesuffix(".weight")
        modules.add(module.rsplit(".", 1)[-1])
        transposed.add(entry.convert.name != "identity")
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = weights[a].contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = weights[b].contiguous()
    if not tensors:
        raise PeftExportError("--peft: the checkpoint holds no adapters")
    if len(transposed) > 1:
        raise PeftExportError(
            "--peft: the adapted linears are stored both as they are and transposed; one "
            "adapter_config.json cannot say both (give --lora-targets of one kind)"
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": lora.rank,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "fan_in_fan_out": transposed.pop(),
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    _replace(folder / ADAPTER_FILE, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _replace(
        folder / CONFIG_FILE,
        lambda p: Path(p).write_text(json.dumps(adapter_config, indent=2) + "\n"),
    )
    return folder


def _hf_entries(family: Any, config: Any, base: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The family's HF key-map entries of the base's keys, by state key (``key_map``)."""
    if not hasattr(family, "key_map"):
        name = getattr(family, "name", type(family).__name__)
        raise PeftExportError(f"--peft: family {name!r} has no Hugging Face key map (key_map)")
    shapes = {key: tuple(t.shape) for key, t in base.items()}
    return {entry.key: entry for entry in family.key_map(config).expand(shapes)}


def _replace(path: Path, write: Any) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    write(str(temporary))
    fsync_path(temporary)
    temporary.replace(path)
