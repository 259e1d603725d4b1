"""``dataflow perfetto BUNDLE -o trace.json``: one Perfetto trace of an exported run.

Reads a bundle (``dataflow export``, ``dataflow train --trace-steps``) and writes its
predicted timeline and, when the bundle has one, its measured timeline as one
trace-event file (``dataflow.timeline.perfetto``): open it at ui.perfetto.dev.
"""

from __future__ import annotations

import click

from dataflow.cli.errors import Failure
from dataflow.cli.options import OutputFile, write_to


def write_perfetto(bundle_dir: str, output: str) -> str:
    """Write the Perfetto trace of the bundle in ``bundle_dir`` to ``output``; return a
    line saying what was written. A bad bundle is a ``Failure`` naming the file."""
    from dataflow.bundle import BundleError, read_bundle
    from dataflow.timeline import write_trace_document
    from dataflow.timeline.perfetto import perfetto_trace

    try:
        bundle = read_bundle(bundle_dir)
    except BundleError as exc:
        raise Failure(str(exc)) from None
    document = perfetto_trace(bundle.timeline, bundle.measured)
    write_trace_document(write_to(output), document)
    shown = "predicted and measured" if bundle.measured is not None else "predicted only"
    return f"wrote {output}: {bundle.program.name}, {shown}; open it at ui.perfetto.dev"


@click.command("perfetto")
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option(
    "-o", "--output", default="trace.json", show_default=True, type=OutputFile(), metavar="OUT"
)
def perfetto_command(bundle_dir: str, output: str) -> None:
    """Write one Perfetto trace of a bundle: predicted and measured, side by side."""
    click.echo(write_perfetto(bundle_dir, output))
