"""The ``torch`` resolver: lowered training tasks -> executables."""
