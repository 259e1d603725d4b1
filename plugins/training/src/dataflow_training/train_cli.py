"""``dataflow train``: the main job as a command (added by the training plugin).

A thin layer over ``dataflow_training.trainer.train``: options are checked first (an
installed family whose preset it is, a sequence length the model takes, a budget the
step can be planned into), then the run prints its plan line and trains, with a rich
progress bar on a terminal and plain lines otherwise, and ends with a line of the loss
from first to last step and the fast-memory peak against the budget. Every failure is
one line.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from dataflow.cli.errors import Failure, one_line
from dataflow.cli.options import COUNT, Device
from dataflow_training.cli import _check_seq_len, _family, _preset_config, budget_option
from dataflow_training.trainer import SCHEDULES


def default_family(preset: str) -> str:
    """The one installed family that has ``preset``."""
    from dataflow.plugins import families

    owners = []
    for spec in families():
        try:
            presets = getattr(spec.load(), "presets", ())
        except Exception:  # a broken family plugin cannot own the preset
            continue
        if preset in presets:
            owners.append(spec.name)
    if len(owners) == 1:
        return owners[0]
    if not owners:
        raise click.BadParameter(
            f"no installed family has a preset {preset!r}; name one with --family",
            param_hint="--preset",
        )
    raise click.BadParameter(
        f"preset {preset!r} is in families {', '.join(owners)}; pick one with --family",
        param_hint="--preset",
    )


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_budget(device: str) -> int | None:
    """The device's free memory now (CPU: unbounded)."""
    if device == "cpu":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


@click.command("train")
@click.option("--preset", required=True, help="a family preset, e.g. gpt2_tiny")
@click.option("--family", "family_name", default=None, help="default: the preset's family")
@click.option("--steps", required=True, type=COUNT, help="optimizer updates in the whole run")
@click.option(
    "--data",
    default="embedded:python-stdlib",
    show_default=True,
    help="a feed spec SCHEME:LOCATION (shards:DIR, text:PATH, ...)",
)
@click.option("--batch", default=8, show_default=True, type=COUNT)
@click.option("--ga-rounds", "rounds", default=1, show_default=True, type=COUNT)
@click.option("--seq-len", default=64, show_default=True, type=COUNT)
@budget_option("fast-memory budget (default: the device's free memory; CPU: unbounded)")
@click.option("--device", default=None, type=Device(), help="default: cuda when present")
@click.option("--checkpoint-every", default=None, type=COUNT, help="steps between checkpoints")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="run folder")
@click.option("--resume", default=None, help="auto (newest complete checkpoint) or a folder")
@click.option("--keep", default=None, type=COUNT, help="keep only the newest N checkpoints")
@click.option("--lr", default=3e-4, show_default=True, type=click.FloatRange(min=0))
@click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--schedule", default="cosine", show_default=True, type=click.Choice(SCHEDULES))
@click.option("--min-lr-ratio", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option(
    "--clip",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="max global grad norm (0: off)",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]))
@click.option(
    "--graph/--no-graph",
    default=True,
    show_default=True,
    help="on CUDA, replay every step after the first from one captured CUDA graph "
    "(--no-graph dispatches every task from the host: per-task NVTX ranges in --profile)",
)
@click.option(
    "--recompute/--no-recompute",
    default=True,
    show_default=True,
    help="let the recompute planner re-derive saved activations where that is faster or fits",
)
@click.option(
    "--profile",
    is_flag=True,
    help="trace a window of warmed steps: torch.profiler Chrome trace; on CUDA also NVTX "
    "ranges and cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi)",
)
@click.option(
    "--profile-start-before-step",
    "profile_start",
    type=int,
    default=None,
    help="first profiled step (default: 5, or the last step of a shorter run)",
)
@click.option(
    "--profile-stop-after-step",
    "profile_stop",
    type=int,
    default=None,
    help="last profiled step (default: three steps after the first, or the last step)",
)
@click.option(
    "--prof-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="where the trace goes (default: OUT/profile)",
)
def train_command(
    family_name,
    preset,
    device,
    budget_bytes,
    clip,
    profile,
    profile_start,
    profile_stop,
    prof_dir,
    **rest: Any,
) -> None:
    """Train a family preset on a feed: plan line, progress, metrics.jsonl, checkpoints."""
    from dataflow.planning import InfeasibleBudget
    from dataflow.units import format_size
    from dataflow_training.checkpoint import CheckpointError
    from dataflow_training.trainer import Interrupted, TrainingStopped, TrainOptions, train

    window = _profile_window(profile, profile_start, profile_stop, prof_dir, rest)
    family_name = family_name or default_family(preset)
    config = _preset_config(_family(family_name), family_name, preset)
    _check_seq_len(config, preset, rest["seq_len"])
    device = device or default_device()
    if budget_bytes is None:
        budget_bytes = default_budget(device)
    options = TrainOptions(
        family=family_name,
        preset=preset,
        device=device,
        budget_bytes=budget_bytes,
        clip=clip or None,
        profile=window,
        **rest,
    )
    try:
        summary = train(options, progress=_progress(options.steps))
    except InfeasibleBudget as exc:
        raise Failure(
            f"--budget {format_size(budget_bytes)} is too small for this step: the smallest "
            f"budget that works is {format_size(exc.minimal_budget_bytes)} "
            f"({exc.minimal_budget_bytes} bytes)"
        ) from None
    except CheckpointError as exc:
        raise Failure(f"--resume: {one_line(str(exc))}") from None
    except TrainingStopped as exc:
        raise Failure(str(exc)) from None
    except Interrupted as exc:
        click.echo(f"stopping after step {exc.step}; wrote {exc.path}", err=True)
        raise KeyboardInterrupt from None  # the core's exit path: "interrupted", exit 130
    except (ValueError, LookupError) as exc:
        raise Failure(one_line(str(exc))) from None
    if summary["last"]:
        click.echo(done_line(summary, options.out))


def done_line(summary: dict[str, Any], out: Any) -> str:
    """``done: step 300, loss 5.5206 -> 2.3435; fast peak 1.99 MiB of the 2 MiB budget;
    checkpoints in runs/main``: the first step's loss and the last's, the ledger's fast
    peak over the run (on CUDA also the allocator's) against the budget."""
    from dataflow.units import format_size
    from dataflow_training.trainer import budget_text

    last, first = summary["last"], summary["first"]
    loss = f"{first[1]:.4f} -> {last['loss']:.4f}" if first else f"{last['loss']:.4f}"
    peak = f"fast peak {format_size(summary['fast_peak_bytes'])}"
    if last["allocator_peak_bytes"] is not None:
        peak += f" (allocator {format_size(last['allocator_peak_bytes'])})"
    budget = summary["budget_bytes"]
    peak += " with no budget" if budget is None else f" of the {budget_text(budget)} budget"
    return f"done: step {last['step']}, loss {loss}; {peak}; checkpoints in {out}"


def _profile_window(
    profile: bool, start: int | None, stop: int | None, folder: str | None, rest: dict
) -> Any:
    """The ``--profile`` window, or None; a usage error naming the option when the
    range options make no sense."""
    from pathlib import Path

    from dataflow_training.profiling import ProfileWindow

    if not profile:
        given = [
            name
            for name, value in (
                ("--profile-start-before-step", start),
                ("--profile-stop-after-step", stop),
                ("--prof-dir", folder),
            )
            if value is not None
        ]
        if given:
            raise click.UsageError(f"{', '.join(given)} needs --profile")
        return None
    folder = folder or Path(rest["out"]) / "profile"
    try:
        return ProfileWindow.checked(start, stop, rest["steps"], folder)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _progress(steps: int) -> Any:
    """A rich progress bar on a terminal, else a plain line at step 1 and every ~5 % of
    the run."""
    import time

    from dataflow_training.trainer import elapsed_eta

    started = time.perf_counter()
    if sys.stdout.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tok_s]:,.0f} tok/s"),
            TimeRemainingColumn(),
        )
        task = None

        def update(step: int, total: int, metrics: dict[str, Any]) -> None:
            nonlocal task
            if task is None:
                bar.start()
                task = bar.add_task("train", total=total, completed=step - 1, loss=0, tok_s=0)
            bar.update(task, completed=step, loss=metrics["loss"], tok_s=metrics["tok_s"] or 0)
            if step == total:
                bar.stop()

        return update
    every = max(1, steps // 20)

    def line(step: int, total: int, metrics: dict[str, Any]) -> None:
        if step % every and step not in (1, total):
            return
        eta = elapsed_eta(started, step, total)
        norm = metrics["grad_norm"]
        click.echo(
            f"step {step}/{total} loss {metrics['loss']:.4f} lr {metrics['lr']:.3g} "
            f"grad_norm {norm:.3g} tok/s {metrics['tok_s'] or 0:,.0f} eta {eta:.0f}s"
        )

    return line
