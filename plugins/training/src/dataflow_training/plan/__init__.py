"""Pricing a lowered step, the recompute search and the compiled step (imports step and kit)."""
