"""The ``torch`` resolver: lowered training tasks -> executables.

Public beside the resolvers (entry points): ``CompiledStrategy``, the strategy that runs a
family's block math and its writes compiled (``dataflow_training.drive.Strategy``), for an
outside program's executables to run the same math as the ``torch-compiled`` resolver.
Light: each name is imported from its module when first used.
"""

from dataflow import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {"dataflow_resolver_torch.compiled": ("CompiledStrategy",)}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
