"""One member of a test fleet (run as a script by ``test_fleet.py``): trains gpt2_tiny
on its slice of fixed global batches and saves every step's fleet loss, gradient norm
and weights for the test to compare against one process that ran all the rounds."""

from __future__ import annotations

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
    from dataflow_training.config import TrainConfig

    return TrainConfig(seq_len=SEQ_LEN, batch=BATCH, rounds=rounds, clip=clip, grad_norm=True)


def main(out: str, rounds_text: str, steps: int, clip_text: str, device: str = "cpu") -> None:
    from dataflow_training.fleet import join
    from dataflow_training.run import TrainingRun

    rounds = [int(r) for r in rounds_text.split(",")]
    clip = None if clip_text == "none" else float(clip_text)
    fleet = join(rounds, BATCH, SEQ_LEN, device=device)
    mine = rounds[fleet.rank]
    first = sum(rounds[: fleet.rank])
    train = train_config(mine, clip)
    run = TrainingRun("gpt2", PRESET, train, seed=0, grad_share=fleet.share, device=device)
    record = []
    for step in range(steps):
        batches = global_batches(step, sum(rounds))[first : first + mine]
        stats = run.step(batches, lr=1e-3)
        weights, _opt = run.state()
        record.append((fleet.mean_loss(stats.losses), stats.grad_norm, weights))
    run.close()
    torch.save(record, os.path.join(out, f"rank{fleet.rank}.pt"))
    fleet.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
