"""The Program schema: frozen records, one converter, and structural validation.

Pure Python: importing it never imports torch.
"""

from dataflow.schema.converter import PROGRAM_SCHEMA, SchemaError
from dataflow.schema.objects import DTYPE_BYTES, Location, Obj, Role, TensorMeta
from dataflow.schema.program import Budget, Link, Links, Program
from dataflow.schema.tasks import PROLOGUE, Directive, Prologue, Resource, Task
from dataflow.schema.validate import Problem, validate

__all__ = [
    "DTYPE_BYTES",
    "PROGRAM_SCHEMA",
    "PROLOGUE",
    "Budget",
    "Directive",
    "Link",
    "Links",
    "Location",
    "Obj",
    "Problem",
    "Program",
    "Prologue",
    "Resource",
    "Role",
    "SchemaError",
    "Task",
    "TensorMeta",
    "validate",
]
