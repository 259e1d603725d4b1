"""``dataflow predict`` without ``--t-round``: the step search of ``dataflow train``
(``drive.step_search``) for the options given, its choice and runner-up as rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from dataflow import format_size
from dataflow.cli import Failure, one_line
from dataflow_training.cli.train_defaults import default_device, default_family
from dataflow_training.cli.verify_cli import _check_seq_len, _family, _preset_config
from dataflow_training.plan.hardware import HardwareError, hardware

#: the host memory of a hardware entry that states none: more than any plan holds
UNCHECKED_HOST_BYTES = 2**62


def search_command(
    preset: str,
    family_name: str | None,
    hw_name: str | None,
    hw_files: tuple,
    tokens_step: int | None,
    budgets: tuple[int, ...],
    seq_lens: tuple[int, ...] | None,
    vocab_size: int | None,
    backing: tuple[int, ...] | None,
    orders: tuple[str, ...] | None,
    policy: dict[str, Any],
    recompute: bool,
    json_out: str | None,
    measured: Any,
    device: str | None,
    tuning: Any = None,
) -> None:
    """Search as ``dataflow train`` would on ``device`` (default: cuda when present),
    priced as its ``compile_step`` prices, or by the hardware entry ``hw_name``'s
    roofline where one is named, or by the profiling pass with ``measured`` (a family,
    device -> (plan options, cache) function: ``predict_cli.measured_pricing``).
    ``policy``: ``TrainOptions``' precision fields (``precision``, ``dtype``,
    ``optimizer_states``); ``tuning`` (``plan.predict.Tuning``): what trains, by which
    optimizer, as ``dataflow train`` takes them."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.options import TrainOptions
    from dataflow_training.drive.step_search import SEARCHED, search_for
    from dataflow_training.plan.search import PIECES, Pricing

    for option, values in (("--budget", budgets), ("--seq-len", seq_lens), ("--order", orders)):
        if values is not None and len(values) != 1:
            raise click.BadParameter(
                "the search takes one value (a grid: --t-round)", param_hint=option
            )
    if backing is not None and len(backing) != 1:
        raise click.BadParameter("give one backing budget", param_hint="--backing")
    family_name = family_name or default_family(preset)
    family = _family(family_name)
    config = _preset_config(family, family_name, preset)
    seq_len = seq_lens[0] if seq_lens else None
    if seq_len is not None:
        _check_seq_len(config, preset, seq_len)
    device = device or default_device()
    given = {"seq_len": seq_len, "tokens_per_step": tokens_step, "order": orders and orders[0]}
    if tuning is not None:  # pinned pieces (--vocab-pieces, --expert-shards): not searched
        given |= {"vocab_pieces": tuning.vocab_pieces, "expert_shards": tuning.expert_shards}
    overrides = {} if tuning is None else tuning.overrides()
    if vocab_size is not None and vocab_size != getattr(config, "vocab_size", None):
        overrides["vocab_size"] = vocab_size
    o = TrainOptions(
        family=family_name,
        preset=preset,
        steps=1,
        out=Path("."),
        device=device,
        budget_bytes=budgets[0],
        backing_bytes=backing[0] if backing else None,
        **policy,
        **(tuning.options_fields() if tuning is not None else {}),
        recompute=recompute,
        overrides=overrides,
        **{k: v for k, v in given.items() if v is not None and k not in PIECES},
        search=[name for name in SEARCHED if given.get(name) is None],
    )
    pricing, host_bytes = None, None
    if measured is not None:  # predict_cli.measured_pricing
        options, cache = measured(family, device)
        # what the search cache keys on: the profile cache's (None: off, not kept)
        by = None if cache is None else json.dumps(cache.context, sort_keys=True)
        pricing = Pricing(device=device, recompute=recompute, measured_by=by, **options)
    elif hw_name is not None:
        try:
            entry = hardware(hw_name, hw_files)
        except HardwareError as exc:
            raise click.BadParameter(one_line(str(exc)), param_hint="--hw") from None
        param = o.policy.dtype.param
        pricing = Pricing(
            device=device, recompute=recompute, cost=entry.roofline(param), links=entry.links()
        )
        # the entry's host, not this machine's: unstated, the host's memory is not checked
        host_bytes = entry.host_memory_bytes or UNCHECKED_HOST_BYTES
    try:
        _chosen, found = search_for(o, family, pricing=pricing, host_bytes=host_bytes)
    except ValueError as exc:
        raise Failure(one_line(str(exc))) from None
    click.echo(found.line())
    rows = [
        {
            **t.shape.fields(),
            "seq_len": found.seq_len,
            "tok_s": t.tok_s,
            "host_bytes": t.host_bytes,
            "role": role,
        }
        for role, t in (("chosen", found.chosen), ("runner-up", found.runner_up))
        if t is not None
    ]
    table = Table("", "shape", "tok/s", "host memory", title=f"{preset}: the step search")
    for row, t in zip(rows, (found.chosen, found.runner_up), strict=False):
        table.add_row(row["role"], t.shape.text(), f"{t.tok_s:,.0f}", format_size(t.host_bytes))
    Console(width=200).print(table)
    if json_out is not None:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        document = {"search": found.line(), "search_s": found.search_s, "rows": rows}
        out.write_text(json.dumps(document, indent=1) + "\n")
