"""What ``dataflow train`` takes where its command line is silent.

- the family of a preset (``default_family``), the device (``default_device``: CUDA where
  present) and the budget (``default_budget``: the device's free memory);
- with ``--resume``, every option not given, from the resumed run's manifest
  (``take_resumed``, ``RESUMED``), said in a ``resume:`` line;
- a bare ``--data`` path as a feed spec (``data_spec``: ``shards:`` or ``text:``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from dataflow import families, feeds, format_size


def default_family(preset: str) -> str:
    """The one installed family that has ``preset``."""

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


#: ``dataflow train`` parameters a resumed run takes from its manifest's options when not
#: given (parameter name -> TrainOptions field); not the run's folder, the resume itself,
#: the fleet's, or what one invocation does (--trace-steps, --profile and its window)
RESUMED = {
    "family_name": "family",
    "preset": "preset",
    "device": "device",
    "budget_bytes": "budget_bytes",
    "clip": "clip",
    **{
        name: name
        for name in (
            "steps data batch rounds seq_len checkpoint_every checkpoint_minutes keep lr "
            "warmup schedule "
            "min_lr_ratio seed precision dtype optimizer_states graph recompute order updates resolver "
            "head_vocab_tiles head_accumulate vocab_pieces block_row_groups vocab_size eval_every eval_tokens val_data optimizer optimizer_args "
            "freeze phases lora lora_alpha lora_dropout lora_targets lora_base pack_documents"
        ).split()
    },
}


#: expert pins of the precision policy (``step.precision``): a run that recorded them
#: (every run before ``--precision``) resumes with them, unless ``--precision`` is given
PINS = ("dtype", "optimizer_states")


def take_resumed(rest: dict[str, Any], given: dict[str, Any]) -> bool:
    """Fill ``rest`` and ``given`` (the parameters ``train_command`` names) with the
    resumed run's options wherever the command line left them at their defaults, and say
    which in a ``resume:`` line (nothing where there is no checkpoint to resume). A run
    started from ``--init`` keeps its overrides, its folder not needed again. Returns
    whether a checkpoint was found (its step shape is then the run's: no search)."""

    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.checkpoint import resumed_options

    if rest["resume"] != "auto" and not Path(rest["resume"]).is_dir():
        raise click.BadParameter(
            f"checkpoint {rest['resume']} is not a folder", param_hint="--resume"
        )
    found = resumed_options(rest["out"], rest["resume"])
    if found is None:
        return False
    folder, options = found
    ctx = click.get_current_context()
    taken = []
    for name, field in RESUMED.items():
        if field not in options or ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            continue
        if field in PINS and ctx.get_parameter_source("precision") is not ParameterSource.DEFAULT:
            continue  # a --precision given names the whole policy: the run's pins give way
        if name == "optimizer_args" and ctx.get_parameter_source("optimizer") not in (
            ParameterSource.DEFAULT,
            None,
        ):
            continue  # the run's arguments are its optimizer's, not those of one named now
        value = options[field]
        if name == "device" and str(value).startswith("cuda") and not cuda_here():
            continue  # resumed on a machine without one: the default device instead
        if name in ("clip", "checkpoint_minutes"):
            value = value or 0.0  # the command line's 0 is the options' None (off)
        if name in ("freeze", "lora_targets"):
            value = tuple(value)  # a JSON list in the manifest
        if name == "phases":  # as the command line gives them
            value = tuple(f"{p['start']}:{','.join(p['freeze'])}" for p in value)
        target = given if name in given else rest
        if target[name] != value and (target[name] or value):  # () and {}: no arguments
            shown = format_size(value) if field.endswith("_bytes") and value else value
            taken.append(f"{field} {shown}")
        target[name] = value
    backing = options.get("backing_bytes")
    if backing and ctx.get_parameter_source("backing_budgets") is ParameterSource.DEFAULT:
        given["backing_bytes"] = backing
        taken.append(f"backing_bytes {format_size(backing)}")
    if rest["init"] is None and options.get("init") is not None:
        rest["overrides"] = dict(options.get("overrides") or {})
        taken.append(f"overrides {rest['overrides']} (from --init {options['init']})")
    if taken:
        click.echo(f"resume: {', '.join(taken)}: the options of {folder}")
    return True


def cuda_here() -> bool:
    # torch loads when the command runs, not when `dataflow` lists its commands
    import torch

    return torch.cuda.is_available()


#: The feed schemes whose location is a path: ``data_spec`` makes it absolute.
PATH_SCHEMES = ("shards", "text")


def data_spec(data: str, option: str = "--data") -> str:
    """``--data`` (or ``option``, another data source) as a feed spec: ``SCHEME:LOCATION`` as given; a bare path that exists,
    a folder of llm.c shards (``*.bin`` in it) as ``shards:``, any other file or folder as
    ``text:``; a bare path that does not is a usage error, and an unknown scheme is the feed
    registry's to refuse (listing the schemes). The path of a ``shards:`` or ``text:``
    spec is made absolute, so the checkpoints' manifests keep a path that a resume from
    any working directory finds."""

    scheme, colon, location = data.partition(":")
    if colon and scheme in feeds().names():
        if scheme in PATH_SCHEMES and location:
            return f"{scheme}:{Path(location).resolve()}"
        return data
    path = Path(data)
    if not path.exists():
        if colon:
            return data
        raise click.BadParameter(
            f"{data!r} is no file or folder here, nor a feed spec SCHEME:LOCATION (SCHEME "
            f"one of: {', '.join(feeds().names())})",
            param_hint=option,
        )
    if path.is_dir() and any(path.glob("*.bin")):
        return f"shards:{path.resolve()}"
    return f"text:{path.resolve()}"


def default_device() -> str:
    # torch loads when the command runs, not when `dataflow` lists its commands
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_budget(device: str) -> int | None:
    """The device's free memory now (CPU: unbounded)."""
    if device == "cpu":
        return None
    # torch loads when the command runs, not when `dataflow` lists its commands
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
