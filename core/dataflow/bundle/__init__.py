"""Exported runs: a folder of JSON files with the program, its plan and placement, the
predicted timeline, a summary and, once real steps ran, the measured timeline
(docs/exporting_runs.md). Pure Python, like the schema and the simulator."""

from dataflow.bundle.build import (
    ROLE_GROUPS,
    bundle_of,
    link_counters,
    measured_timeline,
    plan_summary,
    predicted_timeline,
    role_counters,
    stalls,
)
from dataflow.bundle.records import (
    MEASURED_FILE,
    Bundle,
    BundleError,
    Directives,
    Measured,
    PlacedBlock,
    PlacementRecord,
    PlanRecord,
    Summary,
    read_bundle,
    write_bundle,
    write_measured,
)

__all__ = [
    "MEASURED_FILE",
    "ROLE_GROUPS",
    "Bundle",
    "BundleError",
    "Directives",
    "Measured",
    "PlacedBlock",
    "PlacementRecord",
    "PlanRecord",
    "Summary",
    "bundle_of",
    "link_counters",
    "measured_timeline",
    "plan_summary",
    "predicted_timeline",
    "read_bundle",
    "role_counters",
    "stalls",
    "write_bundle",
    "write_measured",
]
