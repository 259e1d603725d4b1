"""The ``dataflow`` command: thin click layers over the Python API of the same name."""
