"""How fast is one RL policy update (GRPO) inside a fast-memory budget, beside stock
PyTorch? Issue 49's rows: the example `examples/rl_training` (`PolicyTrainer`: the update
of ``--rows`` rollouts in ``--rounds`` micro-batches, lowered from the engine's hidden
states, planned by PressureFit into ``--budget``, run by the engine) against a stock update
of ``--stock-rows`` of them (the transformers model, ``torch.compile``, fused AdamW, the
whole batch's logits at once), both in ``--dtype`` (default bfloat16, the stock setup's
fastest: pure bf16 weights with fused AdamW, whose state is then bf16 too; the example
keeps its moments in ``--moments``, by default bf16 as well, and its loss and AdamW math in
float32). The plan assumes the rates of the training plugin's hardware entry ``--hw``
(its bf16 or fp32 matmul rate, its host-to-device link). Its rows go into
``benchmarks/results/compare.json`` with ``"mode": "rl"`` and the rollouts' length as
``seq_len``, so each is rated (in tokens/s) against the stock RL row of its length; ``--doc
docs/throughput.md`` rewrites the tables.

Every update moves the model's weights and AdamW moments to the device and back (l3_1b in
bf16: some 7 GiB each way), whatever its rows; rounds let an update take enough rows to
hide that behind compute while only one round's saved contexts live in the budget.
``--predict`` prints the plan's prediction for each budget without running anything: for
l3_1b at 4 GiB (h200 rates) 16 rows in one round are predicted at 73k tok/s, 64 rows in 8
rounds at 103k, 128 rows in 16 rounds at 107k (docs/throughput.md, "An RL policy update in
rounds").

On CUDA the dataflow update runs its blocks compiled (``--blocks``: auto, eager or a
``torch.compile`` backend); ``--graph`` has the engine capture it into a CUDA graph and
replay it (``PolicyTrainer(graph=True)``), the row's note saying whether it replayed.

The rollouts are synthetic but shaped as an engine writes them: random prompts and
completions, the hidden states and behaviour log-probs of one forward of the policy (what
the engine computed while sampling), rewards at random in groups of ``--group-size``.
Each measured step is one update; the first ``--warmup`` are not timed (the stock row
compiles there). On the device::

    source benchmarks/device_setup.sh && pip install -q -e examples/rl_training
    python -m benchmarks.rl_update --preset l3_1b --rows 128 --rounds 16 --budget 4GiB --doc docs/throughput.md

(on the CPU, for a check of the script: ``--family llama3 --preset llama3_tiny --rows 8
--rounds 2 --stock-rows 4 --prompt-len 8 --completion-len 8 --budget 4MiB --device cpu
--no-compile``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch
from dataflow_rl_example import PolicyTrainer, Rollouts, UpdateOptions, lower_update, tasks
from dataflow_rl_example.policy import workspace_estimate
from dataflow_rl_example.standin import load_model
from dataflow_training import load_family
from dataflow_training.plan.hardware import hardware

from benchmarks.harness.compare_doc import (
    finish,
    load_doc,
    make_row,
    row_key,
    save_doc,
    write_table,
)
from benchmarks.harness.measure import device_name, one_line, wall_steps
from dataflow import BudgetBreachError, InfeasibleBudget, format_size, parse_size, plan

RESULTS = Path("benchmarks/results/compare.json")


#: the rows of one forward of ``synthetic_rollouts`` (a vocabulary's logits per row: l3_1b's
#: are 1 GiB in float32)
FORWARD_ROWS = 8


def synthetic_rollouts(model: Any, args: argparse.Namespace, device: str) -> Rollouts:
    """Rollouts of the policy's own forward (on-policy): the inputs of every
    ``--hidden-every``-th block (in the model's dtype); as many rows as the larger of the
    two updates takes."""
    generator = torch.Generator().manual_seed(0)
    rows, length = max(args.rows, args.stock_rows), args.prompt_len + args.completion_len
    tokens = torch.randint(0, model.config.vocab_size, (rows, length), generator=generator)
    prompt = torch.zeros(rows, length, dtype=torch.bool)
    prompt[:, : args.prompt_len] = True
    behaviour = torch.zeros(rows, length)
    kept = range(0, model.config.num_hidden_layers, args.hidden_every)
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in kept}
    with torch.no_grad():
        for start in range(0, rows, FORWARD_ROWS):
            part = tokens[start : start + FORWARD_ROWS].to(device)
            out = model(part[:, :-1], output_hidden_states=True)
            logp = out.logits.float().log_softmax(-1).gather(2, part[:, 1:, None])
            behaviour[start : start + FORWARD_ROWS, 1:] = logp.squeeze(2).cpu()
            for layer in kept:
                # in the model's dtype, as a bf16 engine hands them over: the update
                # then feeds them as they are, with no conversion of its own per update
                hidden[layer].append(out.hidden_states[layer].cpu())
            del out, logp
    return Rollouts(
        tokens=tokens,
        prompt_mask=prompt,
        completion_mask=~prompt,
        behaviour_logprobs=behaviour * ~prompt,
        rewards=torch.rand(rows, generator=generator),
        groups=torch.arange(rows) // args.group_size,
        hidden={layer: torch.cat(parts) for layer, parts in hidden.items()},
    )


def first_rows(rollouts: Rollouts, rows: int) -> Rollouts:
    """The first ``rows`` rows of ``rollouts``."""
    fields = attrs.asdict(rollouts, recurse=False)
    return attrs.evolve(
        rollouts,
        **{name: value[:rows] for name, value in fields.items() if isinstance(value, torch.Tensor)},
        hidden={layer: h[:rows] for layer, h in rollouts.hidden.items()},
    )


def options(args: argparse.Namespace) -> UpdateOptions:
    """The update's options: ``--dtype``, ``--moments``, ``--rounds``, and ``--hw``'s rates
    (its matmul rate unless ``--flops-per-us``)."""
    entry = hardware(args.hw)
    return UpdateOptions(
        dtype=args.dtype,
        moments=args.moments or args.dtype,
        rounds=args.rounds,
        flops_per_us=args.flops_per_us or entry.flops_per_us[args.dtype],
        link_bytes_per_us=entry.h2d_bytes_per_us,
    )


def blocks(args: argparse.Namespace) -> str | None:
    """``PolicyTrainer``'s ``compiled`` for ``--blocks`` (eager: None)."""
    return None if args.blocks == "eager" else args.blocks


def policy_trainer(
    args: argparse.Namespace, family: Any, config: Any, state: dict, budget: int | None
) -> PolicyTrainer:
    """The dataflow update's trainer inside ``budget``: the update's ``options``, its blocks
    run as ``--blocks`` says, captured where ``--graph``."""
    return PolicyTrainer(
        family,
        config,
        state,
        options(args),
        budget_bytes=budget,
        device=args.device,
        compiled=blocks(args),
        graph=args.graph,
    )


def one_budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """A probe's one ``--budget`` (None: none given)."""
    if args.budget is not None and len(args.budget) > 1:
        parser.error("--budget: one budget a run")
    return args.budget[0] if args.budget else None


def clear_device(args: argparse.Namespace) -> None:
    """On CUDA, free what the policy's forward left in the allocator, its cuBLAS workspaces
    too: the engine counts from its load, so they were in a row's peak but not in the
    engine's check (session 33's H100 row read a peak 53 MiB past its 4 GiB budget, the
    engine's check passing). No CUDA graph exists yet whose workspace this could pull away."""
    if args.device.startswith("cuda"):
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def predict(args: argparse.Namespace, family: Any, config: Any) -> None:
    """Print the plan's prediction of the update at each budget (the blocks' inputs handed
    over as ``synthetic_rollouts`` hands them)."""
    seq = args.prompt_len + args.completion_len
    blocks = tuple(range(0, len(family.layers(config)) - 2, args.hidden_every))
    step = lower_update(
        family, config, rows=args.rows, length=seq, hidden_layers=blocks, options=options(args)
    )
    beside = workspace_estimate(step, args.device)
    for budget in args.budget or [None]:
        whole = sum(obj.size_bytes for obj in step.program.objects) + beside
        found = {"rows": args.rows, "rounds": args.rounds, "budget": format_size(budget or whole)}
        if (budget or whole) <= beside:
            print(
                json.dumps(found | {"note": f"the tasks' workspace alone is {format_size(beside)}"})
            )
            continue
        try:
            planned = plan(step.program, (budget or whole) - beside)
        except InfeasibleBudget as error:
            needs = format_size(error.minimal_budget_bytes + beside)
            print(json.dumps(found | {"note": f"infeasible: needs {needs}"}))
            continue
        seconds = planned.makespan_us / 1e6
        print(
            json.dumps(
                found
                | {
                    "makespan_s": round(seconds, 4),
                    "moved_GiB": round(planned.moved_bytes / 2**30, 2),
                    "tok_s": round(args.rows * (seq - 1) / seconds),
                }
            )
        )


def largest_temporaries(trainer: PolicyTrainer, rollouts: Rollouts) -> str:
    """After a budget breach: one more update under ``tasks.task_temporaries``, and the
    three tasks whose temporaries were largest beside the estimate the plan left room for
    (``policy.workspace_estimate``)."""
    try:
        with tasks.task_temporaries() as found:
            trainer.update(rollouts, lr=1e-6)
    except Exception as error:  # noqa: BLE001 - the figures so far are what is wanted
        if not found:
            return f"the tasks' temporaries were not measured ({one_line(error)})"
    worst = sorted(found, key=found.get, reverse=True)[:3]
    estimate = workspace_estimate(trainer.lowered(rollouts), trainer.device)
    listed = ", ".join(f"{task} {format_size(found[task])}" for task in worst)
    return f"largest task temporaries {listed} (estimate {format_size(estimate)})"


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
    planned: Any = None,
) -> dict:
    """A compare.py row (``compare_doc.make_row``) of ``mode`` ``rl``: tokens are the
    rollouts' scored positions (prompt and completion less one), the step one update (of
    ``--rows``, or ``--stock-rows`` for the stock row); a dataflow row carries its plan's
    predicted step and moved bytes."""
    step_s = statistics.median(times) if times else None
    seq = args.prompt_len + args.completion_len
    rows = args.rows if engine == "dataflow" else args.stock_rows
    return make_row(
        args.preset,
        engine,
        {"bfloat16": "bf16", "float32": "fp32"}[args.dtype],
        budget,
        seq_len=seq,
        mode="rl",
        batch=rows,
        tokens_per_step=rows * (seq - 1),
        measured_step_s=step_s,
        allocator_peak_bytes=peak,
        moved_bytes_per_step=planned.moved_bytes if planned is not None else None,
        predicted_step_s=planned.makespan_us / 1e6 if planned is not None else None,
        note=note,
    )


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of an update row (``main``'s; the workspace probe takes them too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--preset", default="l3_1b")
    parser.add_argument("--budget", action="append", type=parse_size, help="repeatable")
    parser.add_argument("--rows", type=int, default=16, help="the dataflow update's rollouts")
    parser.add_argument("--rounds", type=int, default=1, help="micro-batches of --rows")
    parser.add_argument("--stock-rows", type=int, default=16, help="the stock update's rollouts")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=768)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--moments",
        choices=("bfloat16", "float32"),
        default=None,
        help="AdamW's stored moments (default: --dtype, as stock fused AdamW keeps them)",
    )
    parser.add_argument(
        "--hw", default="h200", help="the hardware entry whose rates the plan assumes"
    )
    parser.add_argument(
        "--flops-per-us", type=float, default=None, help="the plan's compute rate (default: --hw's)"
    )
    parser.add_argument(
        "--hidden-every",
        type=int,
        default=1,
        help="hand over the input of every K-th block (the rest rebuilt by the update)",
    )
    parser.add_argument(
        "--predict", action="store_true", help="print the plan's prediction per budget, run nothing"
    )
    parser.add_argument("--no-compile", action="store_true", help="stock row without torch.compile")
    parser.add_argument(
        "--graph",
        action="store_true",
        help="the dataflow update captured into a CUDA graph (PolicyTrainer(graph=True))",
    )
    parser.add_argument(
        "--blocks",
        default="auto",
        help="how the dataflow update runs its blocks' math: auto (compiled on CUDA), eager, "
        "or a torch.compile backend",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="rewrite the tables of this page (docs/throughput.md)",
    )
    return parser


def policy_rollouts(
    args: argparse.Namespace, family: Any, config: Any
) -> tuple[dict, Any, Rollouts]:
    """The seeded policy's state, its transformers model on ``--device`` in ``--dtype``,
    and ``synthetic_rollouts`` of it."""
    torch.manual_seed(0)
    state = family.reference_model(config).state_dict()
    folder = Path(tempfile.mkdtemp())
    family.export_hf(config, state, folder)
    model = load_model(folder).to(args.device, getattr(torch, args.dtype))
    return state, model, synthetic_rollouts(model, args, args.device)


def probe_trainer(
    parser: argparse.ArgumentParser, *, workspaces: bool = False
) -> tuple[argparse.Namespace, int | None, PolicyTrainer, Rollouts]:
    """A probe's start (``benchmarks/probes/rl_*.py``): its parsed options, its one
    ``--budget``, the trainer inside it and the rollouts to update from, the policy model
    that sampled them dropped and the device's cache emptied; ``workspaces``: the cuBLAS
    workspaces freed too (``clear_device``), else left to count as they were."""
    args = parser.parse_args()
    budget = one_budget(parser, args)
    family = load_family(args.family)
    config = family.config(args.preset)
    state, model, rollouts = policy_rollouts(args, family, config)
    del model
    if workspaces:
        clear_device(args)
    else:
        torch.cuda.empty_cache()
    return args, budget, policy_trainer(args, family, config, state, budget), rollouts


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if args.hidden_every < 1:
        parser.error(f"--hidden-every {args.hidden_every}: a whole number >= 1")
    if args.rounds < 1 or args.rows % args.rounds:
        parser.error(f"--rounds {args.rounds}: it must divide --rows {args.rows}")
    try:
        options(args)
    except (LookupError, ValueError) as error:
        parser.error(f"--hw {args.hw}: {one_line(error)}")

    family = load_family(args.family)
    config = family.config(args.preset)
    if args.predict:
        predict(args, family, config)
        return
    state, model, rollouts = policy_rollouts(args, family, config)
    mine, stocks = first_rows(rollouts, args.rows), first_rows(rollouts, args.stock_rows)
    rows = []
    # the stock model waits on the host while dataflow runs: the budget check reads the
    # allocator's whole peak, which its weights on the device would fill (session 31's
    # first 4 GiB row: a peak of 8.63 GB against a plan of 3.19 GB)
    model.to("cpu")
    clear_device(args)
    before = torch.cuda.memory_allocated() if cuda else 0

    for budget in args.budget or [None]:
        trainer = policy_trainer(args, family, config, state, budget)
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, _ = wall_steps(
                lambda i, trainer=trainer: trainer.update(mine, lr=1e-6),
                args.warmup,
                args.steps,
                args.device,
            )
            # less what was on the device before the trainer (none but the rollouts' forward)
            peak = torch.cuda.max_memory_allocated() - before if cuda else None
            # a row asked to replay a graph says so, or why it did not
            note = (
                ("replayed from a CUDA graph" if trainer.replaying else trainer.graph_note)
                if args.graph
                else None
            )
            rows.append(
                row(args, "dataflow", budget, times, peak, note=note, planned=trainer.last_plan)
            )
        except BudgetBreachError as error:  # and which task took the room, measured
            note = f"{one_line(error)}; {largest_temporaries(trainer, mine)}"
            rows.append(row(args, "dataflow", budget, [], None, note=note))
        except Exception as error:  # a row that fails is a row with its reason
            rows.append(row(args, "dataflow", budget, [], None, note=one_line(error)))
        trainer.close()
        print(json.dumps(rows[-1]))

    stock = model.to(args.device).train()
    optimizer = torch.optim.AdamW(stock.parameters(), lr=1e-6, fused=cuda)
    loss = stock_loss if args.no_compile else torch.compile(stock_loss)

    def step(_: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(stock, stocks).backward()
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
    # this run's device, torch and date by row: the model's entry names the run of its
    # other rows (the full-step rows of another device and day, say)
    run = {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    entry = doc["meta"]["models"].setdefault(args.preset, {"family": args.family})
    for field, value in run.items():
        entry.setdefault(field, value)
    details = doc["meta"].setdefault("row_details", {})
    for r in rows:
        details.setdefault(row_key(r), {})["run"] = run
    save_doc(args.out, finish(doc))
    if args.doc is not None:
        write_table(doc, args.doc)
    print(f"wrote {args.out}" + (f" and the tables of {args.doc}" if args.doc else ""))


if __name__ == "__main__":
    main()
