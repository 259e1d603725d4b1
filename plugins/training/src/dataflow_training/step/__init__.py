"""What a training step is and its lowering into a Program (imports nothing above it)."""
