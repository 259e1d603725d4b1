"""What the benchmarks share: the rows of ``benchmarks/compare.py`` and how they are measured.

- ``measure``: wall-clock steps, the device's activity in one profiled step, link
  bandwidth, model FLOPs and MFU, a time limit per row;
- ``stock``, ``stock_decoder``, ``stock_deepseek``: stock PyTorch training steps (GPT-2;
  Llama-style decoders and their mixture-of-experts kin; DeepSeek V3, V3.2 and GLM 5), the
  baseline of every speed figure;
- ``compare_dataflow``: the dataflow rows (``TrainingRun`` inside a budget) and the
  ``TrainConfig`` / ``TrainingRun`` of a row that other scripts reuse;
- ``compare_doc``: the results document (``results/compare.json``), its merging and the
  table of docs/throughput.md;
- ``deepspeed_row``: the DeepSpeed ZeRO-Offload row, run by compare.py as a child process
  (``python -m benchmarks.harness.deepspeed_row``).

``ROOT`` is the repository (where ``python -m benchmarks.NAME`` runs, and where a child
process started that way must run), ``RESULTS`` the committed results folder.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
ROOT = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
