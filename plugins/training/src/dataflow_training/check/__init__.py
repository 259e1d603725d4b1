"""The correctness ladder: ops, tasks and whole steps against the reference (imports below)."""
