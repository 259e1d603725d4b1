"""Pieces every command shares."""

from __future__ import annotations

import click

from dataflow.units import parse_size


def size_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A click callback that turns ``4GiB`` into bytes; a bad size names the option."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
