"""Probe, 2026-12-05 (session 29): what does a LoRA base's dequantize cost on CUDA?

The reference dequantize of one projection, beside the bf16 matmul it feeds.

Answer: in results/lora_base_dequant_<device>.json, written up in docs/finetuning.md
("A base in 8 or 4 bits").

For Llama 3 8B's MLP projection (14336 x 4096) at 4096 tokens (bf16): the forward
matmul with a bf16 weight; ``dequantize_int8`` and ``dequantize_nf4`` (the reference
variants, ``dataflow_training.kit.lora_base``) alone and followed by the same matmul;
each the median of 20 runs timed with CUDA events, after 3 warm-ups. Also whether torch's
own ``torch._weight_int8pack_mm`` (an int8 weight-only matmul) runs on this device, and
its time where it does (it wants the scales in the activations' dtype).

    python -m benchmarks.probes.lora_base_dequant   # on the device; writes $OUT or results/
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from dataflow_training.kit.lora_base import (
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
)

from benchmarks.harness.measure import cuda_median_ms

OUT_FEATURES, IN_FEATURES, TOKENS = 14336, 4096, 4096


def main() -> None:
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, device=device, generator=g) * 0.02
    x = torch.randn(TOKENS, IN_FEATURES, device=device, generator=g, dtype=torch.bfloat16)
    dense = weight.to(torch.bfloat16)
    codes8, scale8 = quantize_int8(weight)
    codes4, absmax4 = quantize_nf4(weight)
    bf16 = torch.bfloat16
    rows = {
        "matmul_bf16_ms": cuda_median_ms(lambda: x @ dense.t()),
        "dequantize_int8_ms": cuda_median_ms(lambda: dequantize_int8(codes8, scale8, bf16)),
        "int8_dequantize_and_matmul_ms": cuda_median_ms(
            lambda: x @ dequantize_int8(codes8, scale8, bf16).t()
        ),
        "dequantize_nf4_ms": cuda_median_ms(lambda: dequantize_nf4(codes4, absmax4, bf16)),
        "nf4_dequantize_and_matmul_ms": cuda_median_ms(
            lambda: x @ dequantize_nf4(codes4, absmax4, bf16).t()
        ),
    }
    try:
        scales = scale8.to(bf16)
        torch._weight_int8pack_mm(x, codes8, scales)
        rows["weight_int8pack_mm_ms"] = cuda_median_ms(
            lambda: torch._weight_int8pack_mm(x, codes8, scales)
        )
    except (RuntimeError, NotImplementedError) as exc:
        rows["weight_int8pack_mm"] = f"not on this device: {str(exc).splitlines()[0][:160]}"
    result = {
        "command": "python -m benchmarks.probes.lora_base_dequant",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"out": OUT_FEATURES, "in": IN_FEATURES, "tokens": TOKENS},
        **rows,
    }
    name = f"lora_base_dequant_{torch.cuda.get_device_name().split()[-1].lower()}.json"
    folder = Path(os.environ.get("OUT") or Path(__file__).parents[1] / "results")
    (folder / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
