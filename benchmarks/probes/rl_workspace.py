"""Probe, 2026-12-06 (session 32): which RL update task outgrows its workspace estimate?

Which task of an RL policy update takes more device memory than
``policy.workspace_estimate`` leaves beside the plan's arena?

Asked because l3_1b's update of 128 rows in 16 rounds at 4 GiB broke its budget on the
H100 (allocator peak 4.84 GB, ledger 2.81 GB). One update at the budget under
``tasks.task_temporaries`` (each launch's allocator peak above the bytes in use before it).

Answer (H100): the head, 1,685 MB against an estimate of 1,151 MB (every other kind under
650 MB): each chunk's (chunk, vocab) float32 log-probs lived on into the next chunk's
log_softmax. Deleted at the chunk's end since: 1,158.8 MB, 3.4 MB past the estimate's
terms, which the estimate now covers with the allocator's rounding of the head's large
blocks (``policy.LARGE_BLOCK_SLACK``). The update still broke 4 GiB by 16 MB then: the
trainer left no ``runtime_reserve_bytes`` (cuBLAS workspaces, the values buffer) beside
the arena, which it now does on CUDA.

    python -m benchmarks.probes.rl_workspace --preset l3_1b --rows 128 --rounds 16 \
        --hidden-every 2 --budget 4GiB
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from dataflow_rl_example import PolicyTrainer, tasks
from dataflow_rl_example.policy import workspace_estimate
from dataflow_rl_example.standin import load_model
from dataflow_training import load_family

from benchmarks.rl_update import options, synthetic_rollouts
from dataflow import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--preset", default="l3_1b")
    parser.add_argument("--budget", type=parse_size, default=None)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--stock-rows", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=768)
    parser.add_argument("--hidden-every", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--moments", default=None)
    parser.add_argument("--hw", default="h200")
    parser.add_argument("--flops-per-us", type=float, default=None)
    args = parser.parse_args()

    family = load_family(args.family)
    config = family.config(args.preset)
    torch.manual_seed(0)
    state = family.reference_model(config).state_dict()
    folder = Path(tempfile.mkdtemp())
    family.export_hf(config, state, folder)
    model = load_model(folder).to("cuda", torch.bfloat16)
    rollouts = synthetic_rollouts(model, args, "cuda")
    del model
    torch.cuda.empty_cache()

    trainer = PolicyTrainer(
        family, config, state, options(args), budget_bytes=args.budget, device="cuda"
    )
    with tasks.task_temporaries() as found:
        trainer.update(rollouts, lr=1e-6)
        torch.cuda.synchronize()
    step = trainer.lowered(rollouts)
    print(json.dumps({"workspace_estimate": workspace_estimate(step, "cuda"), "tasks": len(found)}))
    kinds = {task.id: task.kind for task in step.program.tasks}
    by_kind: dict[str, list[str]] = defaultdict(list)
    for task in found:
        by_kind[kinds[task]].append(task)
    for kind, ids in sorted(by_kind.items()):
        worst = max(ids, key=found.get)
        print(f"{kind:16s} {len(ids):4d} tasks, the most {found[worst] / 1e6:9.1f} MB ({worst})")


if __name__ == "__main__":
    main()
