"""Predicted data-parallel fleets of H200s: gpt2_124m and llama3_8b, 1, 2 and 8 ranks.

    python -m benchmarks.fleet_predict --out benchmarks/results/fleet_predict.json

For each preset, each rank runs the same step as one process would (its rounds inside its
own fast budget), and the step ends with the all-reduce of every gradient group on the
collective link of the ``h200`` hardware entry (``HardwareEntry.collective_link``: its
NCCL bus bandwidth and latency per scope, for that many ranks), within one host
(``nvlink``) and over the network (``network``). ``dataflow predict --ranks`` makes each
table; this script runs them all and writes the rows as JSON and the table of
``docs/distributed_training.md`` as Markdown beside it. Roofline prices: nothing is run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dataflow_training.plan.hardware import hardware
from dataflow_training.plan.predict import grid, predict_fleet
from dataflow_training.step.family import load_family

GiB = 2**30
#: preset -> (family, seq_len, T_round, tokens per step and rank, fast budget per rank)
CASES = {
    "gpt2_124m": ("gpt2", 1024, 16384, 65536, 4 * GiB),
    "llama3_8b": ("llama3", 2048, 8192, 65536, 40 * GiB),
}
RANKS = (1, 2, 8)
SCOPES = ("nvlink", "network")


def command(preset: str, scope: str) -> str:
    _, seq_len, t_round, tokens, budget = CASES[preset]
    return (
        f"dataflow predict --preset {preset} --hw h200 --seq-len {seq_len} --t-round {t_round} "
        f"--tokens-step {tokens} --budget {budget // GiB} --ranks {','.join(map(str, RANKS))} "
        f"--scope {scope}"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | scope | ranks | budget a rank | s/step | tok/s a rank | fleet tok/s | "
        "all-reduce ms | exposed ms | hidden ms | scaling eff |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        if not row["feasible"]:
            lines.append(f"| {row['preset']} | {row['scope']} | {row['ranks']} | infeasible |")
            continue
        lines.append(
            f"| {row['preset']} | {row['scope']} | {row['ranks']} | "
            f"{row['budget_bytes'] / GiB:.0f} GiB | {row['step_s']:.4f} | {row['tok_s']:,.0f} | "
            f"{row['fleet_tok_s']:,.0f} | {row['allreduce_s'] * 1e3:.2f} | "
            f"{row['allreduce_exposed_s'] * 1e3:.2f} | {row['allreduce_hidden_s'] * 1e3:.2f} | "
            f"{row['scaling_efficiency']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fleet_predict.json"))
    parser.add_argument("--presets", default=",".join(CASES), help="comma-separated")
    args = parser.parse_args(argv)
    hw = hardware("h200")
    rows, commands = [], []
    for preset in args.presets.split(","):
        family_name, seq_len, t_round, tokens, budget = CASES[preset]
        cells = grid(preset, [t_round], [seq_len], [budget], tokens)
        family = load_family(family_name)
        for scope in SCOPES:
            commands.append(command(preset, scope))
            print(commands[-1], file=sys.stderr)
            rows += predict_fleet(family, cells, hw, RANKS, scope=scope)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"harness": "python -m benchmarks.fleet_predict", "commands": commands, "rows": rows}
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
