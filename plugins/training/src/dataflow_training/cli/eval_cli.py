"""``dataflow eval --from RUN``: the validation loss of a checkpoint, as ``dataflow train
--eval-every`` measures it during the run (``dataflow_training.drive.evaluation``).

A command of its own rather than ``dataflow train --eval-only``: it trains nothing, so
none of train's options (steps, lr, schedule, the step search, the run folder it claims)
applies; it reads the run's options from the checkpoint's manifest and takes only what
an evaluation may change. Every failure is one line.
"""

from __future__ import annotations

import json

import click

from dataflow import InfeasibleBudget, format_size
from dataflow.cli import COUNT, Device, Failure, one_line
from dataflow_training.cli.train_defaults import data_spec
from dataflow_training.cli.verify_cli import budget_option


@click.command("eval")
@click.option(
    "--from",
    "location",
    required=True,
    metavar="RUN",
    help="a run folder (its newest intact checkpoint) or a checkpoint folder",
)
@click.option(
    "--eval-tokens",
    default=None,
    type=COUNT,
    help="tokens to score, rounded up to whole batches (default: the run's --eval-tokens)",
)
@click.option(
    "--val-data",
    default=None,
    help="the held-out data: any data source --data takes (default: the run's --val-data, "
    "else the validation shards of its --data)",
)
@budget_option("fast-memory budget (default: the run's)")
@click.option(
    "--device", default=None, type=Device(), help="default: the run's (cpu where it has no GPU)"
)
@click.option("--json", "as_json", is_flag=True, help="print the metrics as one JSON line")
def eval_command(location, eval_tokens, val_data, budget_bytes, device, as_json) -> None:
    """The validation loss (val_loss, val_ppl) of a run's checkpoint, from the run's step
    planned forward-only inside the budget."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.checkpoint import CheckpointError
    from dataflow_training.drive.eval_checkpoint import evaluate_checkpoint

    if val_data is not None:
        val_data = data_spec(val_data, "--val-data")
    try:
        metrics = evaluate_checkpoint(
            location,
            tokens=eval_tokens,
            val_data=val_data,
            budget_bytes=budget_bytes,
            device=device,
            say=None if as_json else click.echo,
        )
    except CheckpointError as exc:
        raise Failure(f"--from: {one_line(str(exc))}") from None
    except InfeasibleBudget as exc:
        raise Failure(
            f"--budget: too small for the forward-only step: the smallest budget that works "
            f"is {format_size(exc.minimal_budget_bytes)} ({exc.minimal_budget_bytes} bytes)"
        ) from None
    except (ValueError, LookupError) as exc:
        raise Failure(one_line(str(exc))) from None
    if as_json:
        click.echo(json.dumps(metrics))
        return
    click.echo(
        f"step {metrics['step']} ({metrics['checkpoint']}): val_loss {metrics['val_loss']:.6f} "
        f"val_ppl {metrics['val_ppl']:.4g} over {metrics['val_tokens']:,} tokens in "
        f"{metrics['eval_s']:.2f} s; fast peak {format_size(metrics['eval_fast_peak_bytes'])}"
    )
