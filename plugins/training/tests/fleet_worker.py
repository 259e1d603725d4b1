"""One member of a test fleet (run as a script by ``test_fleet.py``): trains gpt2_tiny
on its slice of fixed global batches and saves every step's fleet loss, gradient norm
and weights for the test to compare against one process that ran all the rounds."""

from __future__ import annotations

import json
import os
import sys

import torch

PRESET, BATCH, SEQ_LEN, VOCAB = "gpt2_tiny", 2, 8, 256


def global_batches(step: int, rounds: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s ``rounds`` (tokens, targets), the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(rounds):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train_config(rounds: int, clip: float | None):
    from dataflow_training.step.config import TrainConfig

    return TrainConfig(seq_len=SEQ_LEN, batch=BATCH, rounds=rounds, clip=clip, grad_norm=True)


def main(out: str, rounds_text: str, steps: int, clip_text: str, device: str = "cpu") -> None:
    from dataflow_training.drive.fleet import join
    from dataflow_training.drive.run import TrainingRun

    rounds = [int(r) for r in rounds_text.split(",")]
    clip = None if clip_text == "none" else float(clip_text)
    fleet = join(rounds, BATCH, SEQ_LEN, device=device)
    mine = rounds[fleet.rank]
    first = sum(rounds[: fleet.rank])
    train = train_config(mine, clip)
    run = TrainingRun.of("gpt2", PRESET, train, seed=0, grad_share=fleet.share, device=device)
    record = []
    for step in range(steps):
        batches = global_batches(step, sum(rounds))[first : first + mine]
        stats = run.step(batches, lr=1e-3)
        weights, _opt = run.state()
        record.append((fleet.mean_loss(stats.losses), stats.grad_norm, weights))
    with open(os.path.join(out, f"rank{fleet.rank}_order.json"), "w") as f:
        json.dump(collective_order(run), f)
    run.close()
    torch.save(record, os.path.join(out, f"rank{fleet.rank}.pt"))
    fleet.close()


def collective_order(run) -> list[str]:
    """Where the last step broke the collective link's order: an all-reduce that started
    before the task completing its gradient ended, or a task reading the gradient that
    started before the all-reduce ended (empty: none)."""
    program = run.compiled.program
    spans = {t.task: (t.start_us, t.end_us) for t in run.last_result.steps[-1].tasks}
    tasks = list(program.tasks)
    wrong = [] if any(t.collective for t in tasks) else ["no collective task in the step"]
    for at, task in enumerate(tasks):
        if not task.collective:
            continue
        (dw,) = task.mutates
        users = [i for i, t in enumerate(tasks) if t is not task and dw in t.uses]
        producer = tasks[max(i for i in users if i < at)].id
        if spans[task.id][0] < spans[producer][1]:
            wrong.append(f"{task.id} started before {producer} ended")
        for i in (i for i in users if i > at):
            if spans[tasks[i].id][0] < spans[task.id][1]:
                wrong.append(f"{tasks[i].id} started before {task.id} ended")
    return wrong


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
