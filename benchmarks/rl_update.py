"""How fast is one RL policy update (GRPO) inside a fast-memory budget, beside stock
PyTorch? Issue 49's rows: the example `examples/rl_training` (`PolicyTrainer`: the update
lowered from the engine's hidden states, planned by PressureFit into ``--budget``, run by
the engine) against a stock update of the same model and batch (the transformers model,
``torch.compile``, fused AdamW, the whole batch's logits at once), both in ``--dtype``
(default bfloat16, the stock setup's fastest: pure bf16 weights with fused AdamW; the
example keeps its moments and loss in float32). Its rows go into ``benchmarks/results/compare.json``
with ``"mode": "rl"`` and the rollouts' length as ``seq_len``, so each is rated against the
stock RL row of its length; ``--doc docs/throughput.md`` rewrites the tables.

The rollouts are synthetic but shaped as an engine writes them: random prompts and
completions, the hidden states and behaviour log-probs of one forward of the policy (what
the engine computed while sampling), rewards at random in groups of ``--group-size``.
Each measured step is one update; the first ``--warmup`` are not timed (the stock row
compiles there). On the device::

    source benchmarks/device_setup.sh && pip install -q -e examples/rl_training
    python -m benchmarks.rl_update --preset l3_1b --budget 4GiB --budget 16GiB --doc docs/throughput.md

(on the CPU, for a check of the script: ``--family llama3 --preset llama3_tiny --rows 8
--prompt-len 8 --completion-len 8 --budget 4MiB --device cpu --no-compile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from dataflow_rl_example import PolicyTrainer, Rollouts, UpdateOptions
from dataflow_rl_example.standin import load_model
from dataflow_training import load_family

from benchmarks.harness.compare_doc import (
    finish,
    load_doc,
    make_row,
    row_key,
    save_doc,
    write_table,
)
from benchmarks.harness.measure import device_name, one_line, wall_steps
from dataflow import parse_size

RESULTS = Path("benchmarks/results/compare.json")


def synthetic_rollouts(model: Any, args: argparse.Namespace, device: str) -> Rollouts:
    """Rollouts of the policy's own forward (on-policy): hidden states of every block."""
    generator = torch.Generator().manual_seed(0)
    rows, length = args.rows, args.prompt_len + args.completion_len
    tokens = torch.randint(0, model.config.vocab_size, (rows, length), generator=generator)
    prompt = torch.zeros(rows, length, dtype=torch.bool)
    prompt[:, : args.prompt_len] = True
    with torch.no_grad():
        out = model(tokens[:, :-1].to(device), output_hidden_states=True)
        logp = out.logits.float().log_softmax(-1).gather(2, tokens[:, 1:, None].to(device))
    behaviour = torch.zeros(rows, length)
    behaviour[:, 1:] = logp.squeeze(2).cpu()
    layers = model.config.num_hidden_layers
    return Rollouts(
        tokens=tokens,
        prompt_mask=prompt,
        completion_mask=~prompt,
        behaviour_logprobs=behaviour * ~prompt,
        rewards=torch.rand(rows, generator=generator),
        groups=torch.arange(rows) // args.group_size,
        hidden={layer: out.hidden_states[layer].float().cpu() for layer in range(layers)},
    )


def stock_loss(model: Any, rollouts: Rollouts) -> torch.Tensor:
    """GRPO's loss on the whole batch's logits at once (clip 0.2, no KL)."""
    device = next(model.parameters()).device
    tokens = rollouts.tokens.to(device)
    logits = model(tokens[:, :-1]).logits.float()
    logp = logits.log_softmax(-1).gather(2, tokens[:, 1:, None]).squeeze(2)
    mask = rollouts.completion_mask[:, 1:].float().to(device)
    rewards, groups = rollouts.rewards.to(device), rollouts.groups.to(device)
    count = int(groups.max()) + 1
    mean = torch.stack([rewards[groups == g].mean() for g in range(count)])
    std = torch.stack([rewards[groups == g].std() for g in range(count)])
    adv = ((rewards - mean[groups]) / (std[groups] + 1e-4))[:, None]
    ratio = (logp - rollouts.behaviour_logprobs[:, 1:].to(device)).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


def row(
    args: argparse.Namespace,
    engine: str,
    budget: int | None,
    times: list[float],
    peak: Any,
    note=None,
) -> dict:
    """A compare.py row (``compare_doc.make_row``) of ``mode`` ``rl``: tokens are the
    rollouts' scored positions (prompt and completion less one), the step one update."""
    step_s = statistics.median(times) if times else None
    seq = args.prompt_len + args.completion_len
    return make_row(
        args.preset,
        engine,
        {"bfloat16": "bf16", "float32": "fp32"}[args.dtype],
        budget,
        seq_len=seq,
        mode="rl",
        batch=args.rows,
        tokens_per_step=args.rows * (seq - 1),
        measured_step_s=step_s,
        allocator_peak_bytes=peak,
        note=note,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--preset", default="l3_1b")
    parser.add_argument("--budget", action="append", type=parse_size, help="repeatable")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=768)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--no-compile", action="store_true", help="stock row without torch.compile")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="rewrite the tables of this page (docs/throughput.md)",
    )
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")

    family = load_family(args.family)
    config = family.config(args.preset)
    torch.manual_seed(0)
    state = family.reference_model(config).state_dict()
    folder = Path(tempfile.mkdtemp())
    family.export_hf(config, state, folder)
    model = load_model(folder).to(args.device, getattr(torch, args.dtype))
    rollouts = synthetic_rollouts(model, args, args.device)
    rows = []

    for budget in args.budget or [None]:
        trainer = PolicyTrainer(
            family,
            config,
            state,
            UpdateOptions(dtype=args.dtype),
            budget_bytes=budget,
            device=args.device,
        )
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, _ = wall_steps(
                lambda i, trainer=trainer: trainer.update(rollouts, lr=1e-6),
                args.warmup,
                args.steps,
                args.device,
            )
            peak = torch.cuda.max_memory_allocated() if cuda else None
            rows.append(row(args, "dataflow", budget, times, peak))
        except Exception as error:  # a row that fails is a row with its reason
            rows.append(row(args, "dataflow", budget, [], None, note=one_line(error)))
        trainer.close()
        print(json.dumps(rows[-1]))

    stock = model.train()
    optimizer = torch.optim.AdamW(stock.parameters(), lr=1e-6, fused=cuda)
    loss = stock_loss if args.no_compile else torch.compile(stock_loss)

    def step(_: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(stock, rollouts).backward()
        optimizer.step()

    engine = "pytorch eager" if args.no_compile else "pytorch compile"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, _ = wall_steps(step, args.warmup, args.steps, args.device)
        rows.append(
            row(args, engine, None, times, torch.cuda.max_memory_allocated() if cuda else None)
        )
    except Exception as error:
        rows.append(row(args, engine, None, [], None, note=one_line(error)))
    print(json.dumps(rows[-1]))

    doc = load_doc(args.out)
    keys = {row_key(r) for r in rows}
    doc["rows"] = [r for r in doc["rows"] if row_key(r) not in keys] + rows
    entry = doc["meta"]["models"].setdefault(args.preset, {"family": args.family})
    entry |= {"device": device_name(args.device), "torch": torch.__version__}
    save_doc(args.out, finish(doc))
    if args.doc is not None:
        write_table(doc, args.doc)
    print(f"wrote {args.out}" + (f" and the tables of {args.doc}" if args.doc else ""))


if __name__ == "__main__":
    main()
