"""dataflow-viewer: a plan beside its run, as one offline HTML report (``dataflow report``)
or a local page that re-plans (``dataflow serve``). See docs/exporting_runs.md."""
