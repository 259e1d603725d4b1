"""dataflow-kernels-torch: reference PyTorch variants of every op ``dataflow_training.step.ops``
names, registered through the ``dataflow_kernels`` hook (``plugin.py``).

- ``functional``: attention (two variants), layer_norm, rms_norm, gelu, silu, linear.
- ``cross_entropy``: chunked_cross_entropy, with its gradients.
- ``adamw``: the fused step and the float32 reference step.

Importing this package imports no torch; the modules above do.
"""

__version__ = "0.1.0"
