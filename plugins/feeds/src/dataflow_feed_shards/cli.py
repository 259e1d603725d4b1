"""``dataflow data prepare``: text into llm.c token shards (added by dataflow-feed-shards).

Options are checked before any work: the text path exists, the token counts are whole
numbers (``--shard-tokens`` >= 1, ``--val-tokens`` >= 0), the output is a folder or can
be made one, at most one of ``--resume`` and ``--replace``. Each file written is printed
as it is written, then what was read and what was passed over.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from dataflow.cli import COUNT, Failure

if TYPE_CHECKING:
    from dataflow_feed_shards.prepare import Prepared


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
    help="the folder the shards and the tokenizer are written to (renamed into place once "
    "complete)",
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
@click.option(
    "--resume",
    is_flag=True,
    help="continue the prepare of -o that was killed, keeping its complete shards",
)
@click.option(
    "--replace",
    is_flag=True,
    help="start over: remove what a killed prepare left, and replace the dataset in -o "
    "once the new one is complete",
)
def prepare_command(
    text: Path,
    tokenizer: str,
    out: Path,
    shard_tokens: int,
    val_tokens: int,
    resume: bool,
    replace: bool,
) -> None:
    """Tokenize text into llm.c shards, with the tokenizer saved beside them."""
    from dataflow_feed_shards.errors import FeedError
    from dataflow_feed_shards.prepare import prepare

    if not (tokenizer in ("bytes",) or tokenizer.startswith("bpe:") or Path(tokenizer).is_file()):
        raise click.BadParameter(
            f"{tokenizer!r} is not bytes, bpe:N or an existing tokenizer.json file",
            param_hint="--tokenizer",
        )
    if resume and replace:
        raise click.UsageError("--resume and --replace exclude each other: pass one")
    try:
        done = prepare(
            text,
            tokenizer,
            out,
            shard_tokens=shard_tokens,
            val_tokens=val_tokens,
            mode="resume" if resume else "replace" if replace else "new",
            report=lambda item: click.echo(f"wrote {item.path}: {item.what}"),
            say=click.echo,
        )
    except FeedError as exc:
        raise Failure(str(exc)) from None
    except OSError as exc:  # a full disk, a folder gone read-only, a file not readable
        raise Failure(
            f"{exc.filename or out}: {exc.strerror or exc}; the shards complete so far are "
            f"kept beside {out}: once that is fixed, rerun with --resume to continue"
        ) from None
    click.echo(read_line(done))
    if done.already:
        click.echo(f"{out} is complete already ({done.shards} shard(s)): nothing to do")
    click.echo(f"{done.shards} shard(s) in {out}; train on them with --data shards:{out}")


def read_line(done: Prepared) -> str:
    """``read 12 text files (2 empty, passed over); skipped 4 other files: 3 .png, 1
    without extension; 2 hidden files or folders not looked into``."""
    line = f"read {done.read} text file(s)"
    if done.empty:
        line += f" ({done.empty} empty, passed over)"
    skipped = done.scan.skipped
    if skipped:
        kinds = [f"{count} {suffix or 'without extension'}" for suffix, count in skipped.items()]
        line += f"; skipped {sum(skipped.values())} other file(s): {', '.join(kinds)}"
    if done.scan.hidden:
        line += f"; {done.scan.hidden} hidden file(s) or folder(s) not looked into"
    return line
