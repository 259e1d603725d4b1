"""Entry-point module of dataflow-feed-shards: the ``shards``, ``text`` and ``embedded``
feeds and ``dataflow data prepare``. Imports nothing heavy: numpy, torch and tokenizers
load when a feed opens or the command runs."""

from __future__ import annotations

from typing import Any

from dataflow import hookimpl

#: The spec a run uses when it is given no data.
DEFAULT_SPEC = "embedded:python-stdlib"


def _open(scheme: str):
    def open(location: str, **options: Any) -> Any:
        from dataflow_feed_shards import opening

        return getattr(opening, f"open_{scheme}")(location, **options)

    open.__name__ = f"open_{scheme}"
    return open


@hookimpl
def dataflow_feeds() -> list:
    from dataflow import FeedSpec

    return [
        FeedSpec(
            "shards", _open("shards"), "llm.c token shards of a folder (*.bin), memory-mapped"
        ),
        FeedSpec("text", _open("text"), "a text file or folder of them, byte-tokenized"),
        FeedSpec(
            "embedded",
            _open("embedded"),
            "python-stdlib: this Python's standard library sources, byte-tokenized (no download)",
        ),
    ]


@hookimpl
def dataflow_cli_commands() -> list:
    from dataflow_feed_shards.cli import data_group

    return [data_group]
