"""Engine backends: ``virtual`` (no data, virtual clock) and ``torch`` (cpu or cuda)."""
