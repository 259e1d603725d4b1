"""``dataflow train``: the main job as a command (added by the training plugin).

A thin layer over ``dataflow_training.drive.trainer.train``: options are checked first (an
installed family whose preset it is, a sequence length the model takes, a budget the
step can be planned into), then the run prints its plan line and trains, with a rich
progress bar on a terminal and plain lines otherwise, and ends with a line of the loss
from first to last step and the fast-memory peak against the budget. Every failure is
one line.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from dataflow import InfeasibleBudget, format_size
from dataflow.cli import BUDGET, COUNT, Device, Failure, one_line
from dataflow_training.cli.finetune_options import check_lora, finetune_options
from dataflow_training.cli.optimizer_options import check_optimizer, optimizer_options
from dataflow_training.cli.train_defaults import (
    data_spec,
    default_budget,
    default_device,
    default_family,
    take_resumed,
)
from dataflow_training.cli.verify_cli import (
    _check_seq_len,
    _family,
    _preset_config,
    budget_option,
    optimizer_states_option,
    order_option,
    precision_option,
)
from dataflow_training.drive.conductor import ENV_BACKEND, Topology, conduct
from dataflow_training.drive.fleet import ENV_WORLD, FleetError, in_fleet, join, per_rank
from dataflow_training.drive.hf_init import InitError, hf_overrides, preset_of
from dataflow_training.drive.profiling import ProfileWindow
from dataflow_training.drive.schedule import SCHEDULES
from dataflow_training.step.config import UPDATES

#: the exit status of a run stopped by SIGTERM after writing its checkpoint (128 + 15)
TERMINATED_EXIT = 143

FLEET_HELP = {
    "rounds": "in a fleet: each member's accumulation rounds per step (6,2: a 3:1 data split)",
    "budgets": "in a fleet: each member's fast-memory budget (one value: every member's)",
    "backing": "each member's backing (pinned host) budget, e.g. 60GiB,30GiB (one value: "
    "every member's, or one process's); default: unbounded",
    "topology": "start a fleet: its hosts and groups (see docs/distributed_training.md)",
    "group": "with --topology: the group of members to start",
    "timeout": "seconds a fleet member waits on the others before it fails (default 60)",
}


def fleet_options(command: Any) -> Any:
    """``--rounds``, ``--fast-budget``, ``--backing-budget``, ``--topology``, ``--group``,
    ``--fleet-timeout``."""
    timeout = click.FloatRange(min=1)
    topology = click.Path(dir_okay=False, exists=True)
    for option in reversed(
        (
            click.option("--rounds", "fleet_rounds", metavar="N,N,...", help=FLEET_HELP["rounds"]),
            click.option(
                "--fast-budget", "fleet_budgets", metavar="SIZES", help=FLEET_HELP["budgets"]
            ),
            click.option(
                "--backing-budget", "backing_budgets", metavar="SIZES", help=FLEET_HELP["backing"]
            ),
            click.option("--topology", type=topology, help=FLEET_HELP["topology"]),
            click.option("--group", help=FLEET_HELP["group"]),
            click.option("--fleet-timeout", default=60.0, type=timeout, help=FLEET_HELP["timeout"]),
        )
    ):
        command = option(command)
    return command


@click.command("train")
@click.option(
    "--preset",
    default=None,
    help="a family preset, e.g. gpt2_tiny (with --init, default: the preset nearest the "
    "folder's config.json, its other fields the run's)",
)
@click.option("--family", "family_name", default=None, help="default: the preset's family")
@click.option(
    "--steps",
    default=None,
    type=COUNT,
    help="optimizer updates in the whole run (with --resume, default: the resumed run's)",
)
@click.option(
    "--data",
    default="embedded:python-stdlib",
    show_default=True,
    help="a feed spec SCHEME:LOCATION (shards:DIR, text:PATH, ...), or a path: a folder of "
    "*.bin shards is shards:, another file or folder text:",
)
@click.option("--batch", default=None, type=COUNT, help="sequences a round (default: searched)")
@click.option(
    "--ga-rounds",
    "rounds",
    default=None,
    type=COUNT,
    help="accumulation rounds a step (default: searched)",
)
@click.option(
    "--tokens-per-step",
    default=None,
    type=COUNT,
    help="the optimizer's batch in tokens (default: the fewest within 97% of the fastest "
    "the search finds, up to the preset's published batch; see docs/usage.md)",
)
@fleet_options
@click.option(
    "--seq-len",
    default=None,
    type=COUNT,
    help="default: the preset's context length, or the longest the budget allows",
)
@click.option(
    "--vocab-size",
    default=None,
    type=COUNT,
    help="the model's vocabulary (default: the data's tokenizer's where the shards carry "
    "one, else the preset's); at least the data's",
)
@budget_option("fast-memory budget (default: the device's free memory; CPU: unbounded)")
@click.option("--device", default=None, type=Device(), help="default: cuda when present")
@click.option("--checkpoint-every", default=None, type=COUNT, help="steps between checkpoints")
@click.option(
    "--checkpoint-minutes",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="also a checkpoint once this many minutes passed since the last (0: off)",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="a new run into an --out that holds another run moves that run aside "
    "(OUT.replaced-TIME) instead of being refused",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="run folder")
@click.option(
    "--resume",
    default=None,
    help="auto (newest complete checkpoint) or a folder; every option not given is the "
    "resumed run's (its manifest)",
)
@click.option(
    "--init",
    default=None,
    metavar="FOLDER",
    help="start from the weights of a Hugging Face model folder (config.json beside "
    "model.safetensors or its shards), e.g. to fine-tune; its config.json's fields that "
    "differ from the preset's become the run's (a checkpoint --resume finds comes first)",
)
@click.option("--keep", default=None, type=COUNT, help="keep only the newest N checkpoints")
@click.option("--lr", default=3e-4, show_default=True, type=click.FloatRange(min=0))
@click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--schedule", default="cosine", show_default=True, type=click.Choice(SCHEDULES))
@click.option("--min-lr-ratio", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option(
    "--reset-schedule",
    is_flag=True,
    help="with --resume: start a new lr schedule at the checkpoint's step, of --lr, "
    "--warmup, --schedule and --min-lr-ratio (the run's where not given); without it the "
    "run's schedule goes on (past its end at the lr it ended on) and a change is refused",
)
@click.option(
    "--clip",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="max global grad norm (0: off)",
)
@click.option("--seed", default=0, show_default=True)
@precision_option("auto", "auto: bf16 on CUDA, fp32 elsewhere")
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["fp32", "bf16"]),
    help="expert pin: the weights', grads' and activations' dtype, a plain update "
    "(--precision names the whole policy)",
)
@optimizer_states_option()
@optimizer_options
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
@order_option(default=None, more=" (default: searched)")
@click.option(
    "--updates",
    default=None,
    type=click.Choice(UPDATES),
    help="where the optimizer's updates run: early (each right after its layer's last "
    "backward, while its weights and gradient are still on the GPU; not with --clip), end "
    "(after the whole backward), auto (early in layer orders without --clip, else end); "
    "default: searched",
)
@click.option(
    "--resolver",
    default="auto",
    show_default=True,
    help="the registered resolver that runs the tasks (`dataflow plugins`); auto: the "
    "search's, torch-compiled or torch on CUDA (each block kind's math compiled; the first "
    "steps take longer), torch (eager) elsewhere",
)
@click.option(
    "--pack-documents/--no-pack-documents",
    default=False,
    help="rows hold several documents of the data, each apart: no attention across a "
    "document's boundary, its positions from 0, no target across it (the data's "
    "documents: a text or embedded feed's files, a shards feed's <|endoftext|>; the "
    "family's attention must take segments); see docs/feeds.md",
)
@click.option(
    "--head-vocab-tiles/--no-head-vocab-tiles",
    default=False,
    help="(default: searched) make the head's weight gradient one vocabulary tile at a time: no float32 "
    "(vocab, dim) table in the head's workspace (2.1 GB for Llama 3 8B) for a third more "
    "head compute; for a large vocabulary in a small budget",
)
@click.option(
    "--head-accumulate",
    type=click.Choice(["float32", "gradient"]),
    default="float32",
    show_default=True,
    help="how the head sums its output projection's gradient over a round's chunks: in a "
    "float32 (vocab, dim) table rounded once a round, or added chunk by chunk into its "
    "16-bit gradient (no such table in the head's workspace: 4.1 GB for Qwen 3.5's "
    "head; a rounding a chunk; bf16 weights and an untied head only)",
)
@click.option(
    "--block-row-groups",
    default=1,
    type=COUNT,
    show_default=True,
    help="run each block task's math over the batch's sequences in N groups, one after "
    "the other: the same work in about 1/N of the task's workspace (Qwen 3.5's linear "
    "block's backward: 3.8 GB at batch 4), the gradients rounded once more a group; N "
    "divides --batch; dense blocks only (no routing, Aux or segments, no LoRA)",
)
@click.option(
    "--vocab-pieces",
    default=1,
    type=COUNT,
    help="(default: searched, else 1) store and update the vocabulary tables (the embedding, an untied head) in N row "
    "pieces, each with its own optimizer update: an update holds one piece's weights, "
    "gradient and optimizer state instead of the table's (8.1 GB for Qwen 3.5's head); for "
    "a large vocabulary in a small budget. N divides the vocabulary",
)
@click.option(
    "--expert-shards",
    default=None,
    type=COUNT,
    help="(default: searched, else the preset's) store, run and update each layer's routed "
    "experts in N shards, each its own tasks and optimizer update: no task holds more than "
    "one shard's weights, gradient and optimizer state (a mixture-of-experts model in a "
    "small budget). N divides the experts; a resumed run keeps its checkpoint's",
)
@click.option(
    "--eval-every",
    default=None,
    type=COUNT,
    help="every N steps, the loss of held-out tokens (val_loss, val_ppl): the validation "
    "shards of a shards: --data, or --val-data (see docs/finetuning.md)",
)
@click.option(
    "--eval-tokens",
    default=8192,
    show_default=True,
    type=COUNT,
    help="tokens each evaluation scores (rounded up to whole batches)",
)
@click.option(
    "--val-data",
    default=None,
    help="the held-out data --eval-every scores: any data source --data takes "
    "(default: the validation shards of --data)",
)
@finetune_options
@click.option(
    "--phase",
    "phases",
    multiple=True,
    metavar="START:PATTERNS[:FIELD=VALUE,...]",
    callback=lambda _ctx, _param, value: _phases(value),
    help="from START steps done on, freeze PATTERNS instead (comma-separated; none: "
    "everything trains) and set the config FIELDs; START:@NAME is the family's phase "
    "recipe NAME; 0:... replaces --freeze; repeatable. E.g. --freeze embed --freeze layers "
    "--phase 100: trains the head for 100 steps, then everything",
)
@click.option(
    "--trace-steps",
    default=0,
    type=click.IntRange(min=0),
    help="run the last N steps task by task and write the run's bundle (plan, predicted "
    "and measured timelines, summary) and perfetto.json into OUT",
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
    fleet_rounds,
    fleet_budgets,
    backing_budgets,
    topology,
    group,
    fleet_timeout,
    **rest: Any,
) -> None:
    """Train a family preset on a feed: plan line, progress, metrics.jsonl, checkpoints.
    With --topology and --group: start the group's members as a data-parallel fleet;
    started as a member (torchrun, or by a conductor): train as one."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.checkpoint import CheckpointError, CheckpointWriteError, os_cause
    from dataflow_training.drive.options import TrainOptions
    from dataflow_training.drive.run_folder import RunFolderError
    from dataflow_training.drive.trainer import Interrupted, TrainingStopped, train

    if topology is not None or group is not None:
        _conduct(
            topology,
            group,
            fleet_timeout,
            rest["out"],
            {"--rounds": fleet_rounds, "--fast-budget": fleet_budgets},
            backing_budgets,
        )
        return
    fleet = None
    resumed = False
    if in_fleet():  # the members share one shape: as given, else the pre-search defaults
        rest |= {name: value for name, value in FIXED_SHAPE.items() if rest[name] is None}
        fleet, rest["rounds"], budget_bytes, backing_bytes = _join(
            fleet_rounds, fleet_budgets, backing_budgets, budget_bytes, device, rest
        )
    elif fleet_rounds is not None or fleet_budgets is not None:
        raise click.UsageError(
            "--rounds and --fast-budget are for a fleet (--topology, or torchrun); one "
            "process takes --ga-rounds and --budget"
        )
    else:
        backing_bytes = _backing_budgets(backing_budgets, 1)
        backing_bytes = None if backing_bytes is None else backing_bytes[0]
        if rest["resume"] is not None:  # the options not given are the resumed run's
            given = {"family_name": family_name, "preset": preset, "device": device}
            given |= {"budget_bytes": budget_bytes, "clip": clip, "backing_bytes": backing_bytes}
            resumed = take_resumed(rest, given)
            family_name, preset, device = given["family_name"], given["preset"], given["device"]
            budget_bytes, clip = given["budget_bytes"], given["clip"]
            backing_bytes = given["backing_bytes"]
    # a resumed run's shape is its manifest's; a fleet's as given: the search chooses none
    rest["search"] = () if resumed or fleet is not None else searched_fields(rest)
    if resumed:
        rest |= {name: value for name, value in FIXED_SHAPE.items() if rest[name] is None}
    if not resumed:  # a resumed run's shape is its checkpoint's, which checks it
        _check_pinned_tokens(rest)
        if rest["block_row_groups"] > 1 and rest["batch"] is None:
            raise click.BadParameter(
                "give --batch too (a multiple of it): the step search chooses the batch "
                "without row groups",
                param_hint="--block-row-groups",
            )
    if rest["steps"] is None:
        if rest["resume"] is None:
            raise click.UsageError("Missing option '--steps' (or --resume, to take the run's)")
        raise click.UsageError(
            f"Missing option '--steps': --resume {rest['resume']} found no checkpoint in "
            f"{rest['out']} to take the run's from"
        )

    if rest["reset_schedule"] and rest["resume"] is None:
        raise click.UsageError(
            "--reset-schedule starts a new schedule in a resumed run: give --resume too"
        )
    if rest["updates"] == "early" and clip:
        raise click.BadParameter(
            "early updates cannot clip: every update needs the step's global gradient norm, "
            "known only after the last backward (pass --clip 0, or --updates auto or end)",
            param_hint="--updates",
        )
    if rest["trace_steps"] > rest["steps"]:
        raise click.BadParameter(
            f"{rest['trace_steps']} is more than the run's --steps {rest['steps']}",
            param_hint="--trace-steps",
        )
    check_lora(rest)
    if preset is None:
        if rest["init"] is None:
            raise click.UsageError("Missing option '--preset' (or --init FOLDER to take it from)")

        try:
            family_name, preset = preset_of(rest["init"], family_name)
        except InitError as exc:
            raise Failure(one_line(str(exc))) from None
    window = _profile_window(profile, profile_start, profile_stop, prof_dir, rest)
    family_name = family_name or default_family(preset)
    family = _family(family_name)
    config = _preset_config(family, family_name, preset)
    if rest["init"] is not None:
        try:
            config = hf_overrides(family, family_name, preset, rest["init"]).config
        except InitError as exc:
            raise Failure(one_line(str(exc))) from None
    if rest["seq_len"] is not None:
        _check_seq_len(config, preset, rest["seq_len"])
    if rest["expert_shards"] is not None:
        _check_expert_shards(config, family_name, rest["expert_shards"])
    if not hasattr(config, "expert_shards"):  # no experts: nothing of theirs to search
        rest["search"] = tuple(name for name in rest["search"] if name != "expert_shards")
    device = device or default_device()
    _check_precision(rest, device)
    check_optimizer(rest, device)
    if budget_bytes is None:
        budget_bytes = default_budget(device)
    rest["data"] = data_spec(rest["data"])
    if rest["val_data"] is not None:
        rest["val_data"] = data_spec(rest["val_data"], "--val-data")
    rest["checkpoint_minutes"] = rest["checkpoint_minutes"] or None  # 0: off
    shards = rest.pop("expert_shards")  # a model override (kit.moe.expert_shards)
    overrides = rest.pop("overrides", {})  # a resumed run's
    options = TrainOptions(
        overrides=overrides if shards is None else {**overrides, "expert_shards": shards},
        family=family_name,
        preset=preset,
        device=device,
        budget_bytes=budget_bytes,
        backing_bytes=backing_bytes,
        clip=clip or None,
        profile=window,
        **rest,
    )
    finished = False
    try:
        progress = _progress(options.steps) if fleet is None or fleet.writes else None
        summary = train(options, progress=progress, fleet=fleet, family=family)
        finished = True
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
        if exc.signal == "SIGTERM":  # a scheduler's stop: 128 + 15, as a shell reports it
            click.echo("terminated (SIGTERM)", err=True)
            raise SystemExit(TERMINATED_EXIT) from None
        raise KeyboardInterrupt from None  # the core's exit path: "interrupted", exit 130
    except (RunFolderError, CheckpointWriteError) as exc:
        raise Failure(str(exc)) from None
    except OSError as exc:  # a full disk or a folder gone read-only while the run writes
        raise Failure(f"cannot write {exc.filename}: {os_cause(exc)}") from None
    except FleetError as exc:
        raise Failure(one_line(str(exc))) from None
    except (ValueError, LookupError) as exc:
        raise Failure(one_line(str(exc))) from None
    except RuntimeError as exc:  # a collective that failed: another member is gone
        if fleet is None:
            raise
        raise Failure(f"fleet member stopped: {one_line(str(exc))}") from None
    finally:
        if fleet is not None:
            fleet.close(finished=finished)
    if summary["last"] and (fleet is None or fleet.writes):
        click.echo(done_line(summary, options.out))
    elif not summary["last"] and (fleet is None or fleet.writes):  # resumed at its end
        click.echo(
            f"done: the run is at its last step ({options.steps}); nothing trained (a larger "
            "--steps goes on)"
        )


def _phases(values: tuple[str, ...]) -> tuple[str, ...]:
    """``--phase`` values checked (``drive.phases.Phase.parse``), as given."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.phases import phases_of

    try:
        phases_of(values)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--phase") from None
    return values


def _check_expert_shards(config: Any, family_name: str, shards: int) -> None:
    """``--expert-shards`` for a model of routed experts, dividing their count."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.step.pieces import divisors

    experts = getattr(config, "num_experts", None)
    if not hasattr(config, "expert_shards") or not experts:
        raise click.BadParameter(
            f"family {family_name!r} has no routed experts to shard", param_hint="--expert-shards"
        )
    if experts % shards:
        offered = ", ".join(map(str, divisors(experts)[:6]))
        raise click.BadParameter(
            f"{shards} does not divide the {experts} experts (e.g. {offered})",
            param_hint="--expert-shards",
        )


def _check_precision(rest: dict[str, Any], device: str) -> None:
    """``--precision`` with the pins ``--dtype``/``--optimizer-states``: one policy, or
    one line naming the conflict."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.step.precision import precision

    try:
        precision(
            rest["precision"], device=device, dtype=rest["dtype"], states=rest["optimizer_states"]
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--precision") from None


#: What a fleet member (whose shape every member shares), or a resumed run whose manifest
#: lacks the field, takes for a shape option not given: the defaults from before the step
#: search
FIXED_SHAPE = {"batch": 8, "rounds": 1, "seq_len": 64, "order": "round", "updates": "auto"}


def searched_fields(rest: dict[str, Any]) -> tuple[str, ...]:
    """The step's fields the command line leaves to the search (``step_search.SEARCHED``):
    those not given (a flag or a default left as it is counts as not given)."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.step_search import SEARCHED

    ctx = click.get_current_context()
    free = []
    for name in SEARCHED:
        if name in ("head_vocab_tiles", "resolver", "vocab_pieces"):
            if ctx.get_parameter_source(name) is ParameterSource.DEFAULT:
                free.append(name)
        elif rest[name] is None:
            free.append(name)
    return tuple(free)


def _check_pinned_tokens(rest: dict[str, Any]) -> None:
    """``--tokens-per-step`` a whole number of rounds of the given batch and sequence."""
    tokens = rest["tokens_per_step"]
    if tokens is None:
        return
    given = [rest[name] for name in ("batch", "rounds", "seq_len")]
    per = math.prod(n for n in given if n is not None)
    if tokens % per or (None not in given and tokens != per):
        raise click.BadParameter(
            f"{tokens} tokens is not a whole number of {per}-token parts "
            "(--seq-len x --batch x --ga-rounds, those given)",
            param_hint="--tokens-per-step",
        )


#: options the conductor does not hand on to the members it starts
CONDUCTOR_ONLY = ("topology", "group")


def _conduct(
    topology: str | None,
    group: str | None,
    timeout_s: float,
    out: str,
    per_member: dict[str, str | None],
    backing: str | None,
) -> None:
    """``--topology`` with ``--group``: start the members (with this command's other
    options) and wait for them. ``per_member``: option -> its text, one value per
    member (or one for all), checked against the group's size here."""

    if topology is None or group is None:
        raise click.UsageError("--topology and --group go together")
    try:
        topo = Topology.load(topology)
        topo.members(group)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--topology") from None
    world = len(topo.members(group))
    defaults = {"--fast-budget": "fast", "--backing-budget": "backing"}
    given = {**per_member, "--backing-budget": backing}
    added: list[str] = []
    for option, field in defaults.items():
        if given[option] is None:  # the hosts' own sizes, when the topology sets them
            try:
                sizes = topo.default_sizes(group, field)
            except ValueError as exc:
                raise click.BadParameter(f"{exc}", param_hint="--topology") from None
            if sizes is not None:
                added += [option, sizes]
                if option == "--backing-budget":
                    backing = sizes
                else:
                    per_member = {**per_member, option: sizes}
    for option, text in per_member.items():
        try:
            per_rank(text, world, option, str)
        except ValueError as exc:
            raise click.BadParameter(f"{exc} (group {group})", param_hint=option) from None
    _backing_budgets(backing, world, f" (group {group})")
    args = member_args(click.get_current_context()) + added
    try:
        conduct(topo, group, args, out=Path(out), timeout_s=timeout_s)
    except FleetError as exc:
        raise Failure(str(exc)) from None
    click.echo(f"fleet done: {len(topo.members(group))} member(s); checkpoints in {out}")


def member_args(ctx: click.Context) -> list[str]:
    """This command's options as given (not defaulted), minus the conductor's own: what
    every member is started with."""

    argv: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name in CONDUCTOR_ONLY or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, None):
            continue
        value = ctx.params[name]
        if param.is_flag:
            if param.secondary_opts:
                argv.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                argv.append(param.opts[0])
        elif value is not None:
            argv += [param.opts[0], str(value)]
    return argv


def _backing_budgets(text: str | None, world: int, where: str = "") -> list[int] | None:
    """``--backing-budget`` as one size per member (None: not given). A count that is
    neither 1 nor ``world``, or a size that does not parse, names the option."""

    try:
        return per_rank(text, world, "--backing-budget", lambda v: BUDGET.convert(v, None, None))
    except (ValueError, click.BadParameter) as exc:
        message = exc.message if isinstance(exc, click.BadParameter) else str(exc)
        raise click.BadParameter(f"{message}{where}", param_hint="--backing-budget") from None


def _join(
    rounds_text: str | None,
    budgets_text: str | None,
    backing_text: str | None,
    budget: int | None,
    device,
    rest,
) -> tuple[Any, int, int | None, int | None]:
    """Join the fleet this process was started in: ``(fleet, this member's rounds, its
    budget, its backing budget)``."""

    world = int(os.environ.get(ENV_WORLD, "1"))
    try:
        rounds = per_rank(rounds_text or str(rest["rounds"]), world, "--rounds", int)
        budgets = per_rank(
            budgets_text, world, "--fast-budget", lambda v: BUDGET.convert(v, None, None)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    backing = _backing_budgets(backing_text, world)
    try:
        fleet = join(
            rounds,
            rest["batch"],
            rest["seq_len"],
            device=device or default_device(),
            backend=os.environ.get(ENV_BACKEND, "auto"),
        )
    except FleetError as exc:
        raise Failure(one_line(str(exc))) from None
    mine = budget if budgets is None else budgets[fleet.rank]
    return fleet, rounds[fleet.rank], mine, None if backing is None else backing[fleet.rank]


def done_line(summary: dict[str, Any], out: Any) -> str:
    """``done: step 300, loss 5.5206 -> 2.3435; fast peak 1.99 MiB of the 2 MiB budget;
    checkpoints in runs/main``: the first step's loss and the last's, the ledger's fast
    peak over the run (on CUDA also the allocator's) against the budget."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.trainer import budget_text

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

    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.trainer import elapsed_eta

    started = time.perf_counter()
    if sys.stdout.isatty():
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
            if "val_loss" in metrics:
                bar.console.print(f"step {step}/{total}" + val_text(metrics))
            if step == total:
                bar.stop()

        return update
    every = max(1, steps // 20)

    def line(step: int, total: int, metrics: dict[str, Any]) -> None:
        if step % every and step not in (1, total) and "val_loss" not in metrics:
            return
        eta = elapsed_eta(started, step, total)
        norm = metrics["grad_norm"]
        click.echo(
            f"step {step}/{total} loss {metrics['loss']:.4f} lr {metrics['lr']:.3g} "
            f"grad_norm {norm:.3g} tok/s {metrics['tok_s'] or 0:,.0f} eta {eta:.0f}s"
            + val_text(metrics)
        )

    return line


def val_text(metrics: dict[str, Any]) -> str:
    """`` val_loss 4.1234 val_ppl 61.8`` on a step that evaluated, else nothing."""
    if "val_loss" not in metrics:
        return ""
    return f" val_loss {metrics['val_loss']:.4f} val_ppl {metrics['val_ppl']:.4g}"
