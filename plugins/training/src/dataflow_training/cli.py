"""``dataflow verify``: the correctness ladder as a command (added by the training plugin)."""

from __future__ import annotations

import sys

import click

from dataflow.cli.options import size_callback


@click.command("verify")
@click.option("--family", "family_name", required=True, help="an installed model family")
@click.option("--preset", required=True, help="one of the family's presets")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option(
    "--dtype", "policy", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"])
)
@click.option("--steps", default=2, show_default=True, help="training steps compared")
@click.option("--rounds", default=2, show_default=True, help="accumulation rounds per step")
@click.option("--batch", default=2, show_default=True)
@click.option("--seq-len", default=16, show_default=True)
@click.option(
    "--budget",
    "budget_bytes",
    callback=size_callback,
    default=None,
    help="fast-memory budget for the step runs (e.g. 2GiB)",
)
@click.option("--seed", default=0, show_default=True)
def verify_command(
    family_name, preset, device, policy, steps, rounds, batch, seq_len, budget_bytes, seed
) -> None:
    """Compare ops, tasks and whole training steps against the family's reference."""
    from rich.console import Console
    from rich.table import Table

    from dataflow_training.verify import verify

    checks = verify(
        family_name,
        preset,
        device=device,
        policy=policy,
        steps=steps,
        rounds=rounds,
        batch=batch,
        seq_len=seq_len,
        budget_bytes=budget_bytes,
        seed=seed,
    )
    table = Table("level", "check", "max |diff|", "rel error", "tolerance", "")
    for check in checks:
        table.add_row(
            check.level,
            check.name,
            f"{check.max_abs:.2e}",
            f"{check.rel:.2e}",
            f"{check.tolerance:.0e}"
            + (f" or |diff| <= {check.abs_tolerance:.0e}" if check.abs_tolerance else ""),
            "[green]ok" if check.ok else "[red]FAIL",
        )
    console = Console()
    console.print(table)
    failed = [check for check in checks if not check.ok]
    console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)
