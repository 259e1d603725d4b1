"""Stock LoRA fine-tuning, the baseline of ``benchmarks/compare.py --mode lora``.

What a user runs to fine-tune a preset with LoRA without dataflow: the family's
``transformers`` class (``family.hf_class``) built from the preset's config
(``family.config_to_hf``; random weights, which a step's speed does not depend on) with
SDPA attention and no KV cache, PEFT's ``LoraConfig(r=rank, lora_alpha=alpha,
target_modules=...)`` on exactly the projections dataflow adapts (``targets``: the
modules of ``step.lora.DEFAULT_TARGETS`` the model has; no dropout, no bias), the
adapters in the base's dtype (``get_peft_model(..., autocast_adapter_dtype=False)``: PEFT
would otherwise keep the adapters of a bf16 base in float32), ``torch.compile`` of the
loss (the model's full-vocabulary logits, ``F.cross_entropy`` on every position's
target, as dataflow's step computes it), and ``AdamW(fused=True)`` over the adapters alone
with compare.py's hyperparameters (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1:
dataflow's ``OptimizerPolicy`` defaults, which decay the adapters too).

``dtype``: ``bf16`` (base, adapters, their gradients and AdamW state in bfloat16, as
dataflow's ``bf16`` policy) or ``autocast`` (float32 base and adapters under bf16
autocast).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from dataflow_training.step.lora import DEFAULT_TARGETS
from torch import nn

#: the stock LoRA rows' dtypes (compare.py's ``--stock-dtypes``) -> the base's dtype
BASE_DTYPES = {"bf16": torch.bfloat16, "autocast": torch.float32}


def hf_model(
    family: Any,
    config: Any,
    *,
    dtype: torch.dtype,
    device: str,
    state: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The ``transformers`` model of ``config`` (``family.config_to_hf``), SDPA attention,
    no KV cache, built on ``device`` in ``dtype``; ``state`` (HF tensor names, as
    ``family.export_hf`` writes them) loaded when given, else transformers' own random
    initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(family.config_to_hf(config, dtype))
    fields.pop("architectures", None)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf_config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    if state is not None:
        missing, unexpected = model.load_state_dict(dict(state), strict=False)
        # a tied head has no tensor of its own in the checkpoint
        missing = [
            k for k in missing if not (k == "lm_head.weight" and hf_config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(f"HF state: missing {missing}, unexpected {unexpected}")
    return model


def targets(model: nn.Module) -> list[str]:
    """The module names (last part) of ``model``'s linears that dataflow's LoRA adapts by
    default (``DEFAULT_TARGETS``), sorted."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
        }
    )


def peft_model(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """``model`` with PEFT LoRA adapters of ``rank`` and ``alpha`` on ``targets(model)``,
    in the base's dtype; every other parameter frozen."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=targets(model)
    )
    return get_peft_model(model, lora, autocast_adapter_dtype=False)


def adapter_params(family: Any, config: Any, rank: int) -> int:
    """The adapters' parameters at ``rank``: ``rank * (in + out)`` of every target linear
    of the family's reference model (built on the meta device)."""
    with torch.device("meta"):
        model = family.reference_model(config)
    return sum(
        rank * sum(p.shape)
        for name, p in model.named_parameters()
        if p.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in DEFAULT_TARGETS
    )


def build_stock_lora(
    family: Any,
    config: Any,
    batch: int,
    seq_len: int,
    *,
    rank: int,
    alpha: float,
    compile: bool = False,
    dtype: str = "bf16",
    device: str = "cuda",
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Callable[[int], torch.Tensor], nn.Module]:
    """One stock LoRA step as a function of the step index (four random batches, cycled;
    it returns the loss), and the PEFT model it trains (module docstring)."""
    if dtype not in BASE_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(BASE_DTYPES)}")
    torch.manual_seed(0)
    model = peft_model(
        hf_model(family, config, dtype=BASE_DTYPES[dtype], device=device, state=state),
        rank,
        alpha,
    ).train()
    adapters = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(
        adapters,
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=device.startswith("cuda"),
    )

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    loss_fn = (
        torch.compile(loss_of, backend=compile_backend, mode=compile_mode) if compile else loss_of
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = config.vocab_size
    data = [
        (
            torch.randint(0, vocab, (batch, seq_len), generator=g).to(device),
            torch.randint(0, vocab, (batch, seq_len), generator=g).to(device),
        )
        for _ in range(4)
    ]
    device_type = torch.device(device).type

    def step(i: int) -> torch.Tensor:
        tokens, targets = data[i % len(data)]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            loss = loss_fn(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model
