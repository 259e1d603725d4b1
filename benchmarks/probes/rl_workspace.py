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

It takes ``benchmarks/rl_update.py``'s options (one ``--budget``; the row's own, such as
``--steps`` or ``--doc``, mean nothing here).
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch
from dataflow_rl_example import tasks
from dataflow_rl_example.policy import workspace_estimate

from benchmarks.rl_update import arguments, probe_trainer


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.set_defaults(rows=128, rounds=16, hidden_every=2)
    args, _, trainer, rollouts = probe_trainer(parser)
    with tasks.task_temporaries() as found:
        trainer.update(rollouts, lr=1e-6)
        torch.cuda.synchronize()
    step = trainer.lowered(rollouts)
    print(
        json.dumps(
            {"workspace_estimate": workspace_estimate(step, args.device), "tasks": len(found)}
        )
    )
    kinds = {task.id: task.kind for task in step.program.tasks}
    by_kind: dict[str, list[str]] = defaultdict(list)
    for task in found:
        by_kind[kinds[task]].append(task)
    for kind, ids in sorted(by_kind.items()):
        worst = max(ids, key=found.get)
        print(f"{kind:16s} {len(ids):4d} tasks, the most {found[worst] / 1e6:9.1f} MB ({worst})")


if __name__ == "__main__":
    main()
