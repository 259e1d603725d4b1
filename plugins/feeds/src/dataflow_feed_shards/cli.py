"""``dataflow data prepare``: text into llm.c token shards (added by dataflow-feed-shards).

Options are checked before any work: the text path exists, the token counts are whole
numbers (``--shard-tokens`` >= 1, ``--val-tokens`` >= 0), the output is a folder or can
be made one. Each file written is printed as it is written.
"""

from __future__ import annotations

from pathlib import Path

import click

from dataflow.cli import COUNT, Failure


@click.group("data")
def data_group() -> None:
    """Prepare training data for the feeds (shards:DIR, text:PATH, embedded:python-stdlib)."""


@data_group.command("prepare")
@click.option(
    "--text",
    "text",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="a text file, or a folder of text files (read recursively, in sorted order)",
)
@click.option(
    "--tokenizer",
    default="bytes",
    show_default=True,
    help="bytes, bpe:N (a byte-level BPE of N tokens trained on the text) or a tokenizer.json",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="the folder the shards and the tokenizer are written to",
)
@click.option(
    "--shard-tokens", default=100_000_000, show_default=True, type=COUNT, help="tokens per shard"
)
@click.option(
    "--val-tokens",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="tokens of a first validation shard (val_000000.bin); 0: none",
)
def prepare_command(
    text: Path, tokenizer: str, out: Path, shard_tokens: int, val_tokens: int
) -> None:
    """Tokenize text into llm.c shards, with the tokenizer saved beside them."""
    from dataflow_feed_shards.errors import FeedError
    from dataflow_feed_shards.prepare import prepare

    if not (tokenizer in ("bytes",) or tokenizer.startswith("bpe:") or Path(tokenizer).is_file()):
        raise click.BadParameter(
            f"{tokenizer!r} is not bytes, bpe:N or an existing tokenizer.json file",
            param_hint="--tokenizer",
        )
    try:
        written = prepare(
            text,
            tokenizer,
            out,
            shard_tokens=shard_tokens,
            val_tokens=val_tokens,
            report=lambda item: click.echo(f"wrote {item.path}: {item.what}"),
        )
    except FeedError as exc:
        raise Failure(str(exc)) from None
    shards = [item for item in written if item.path.suffix == ".bin"]
    click.echo(f"{len(shards)} shard(s) in {out}; train on them with --data shards:{out}")
