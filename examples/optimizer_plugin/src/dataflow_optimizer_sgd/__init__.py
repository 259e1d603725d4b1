"""An example third-party optimizer for dataflow: SGD with momentum (``sgd``)."""
