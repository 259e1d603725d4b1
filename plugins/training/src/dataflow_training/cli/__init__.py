"""The commands the training plugin adds to `dataflow` (imports everything below)."""
