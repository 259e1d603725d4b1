"""The engine: runs planned programs for real (torch on cpu or cuda) or on a virtual clock.

Importing it does not import torch; the torch backends load when an engine uses them.
"""

from dataflow.engine.contract import (
    DictResolver,
    Executable,
    LaunchContext,
    MissingValueError,
    Resolver,
    ResolverError,
    RunValues,
)
from dataflow.engine.dispatcher import EngineRunError
from dataflow.engine.engine import BudgetBreachError, Engine, EngineLoadError
from dataflow.engine.result import RunResult

__all__ = [
    "BudgetBreachError",
    "DictResolver",
    "Engine",
    "EngineLoadError",
    "EngineRunError",
    "Executable",
    "LaunchContext",
    "MissingValueError",
    "Resolver",
    "ResolverError",
    "RunResult",
    "RunValues",
]
