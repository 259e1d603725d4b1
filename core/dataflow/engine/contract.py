"""The task contract: how a resolver turns a task into something the engine can launch.

A resolver plugin registers ``ResolverSpec(name, build)``; ``build(program)`` returns a
``Resolver``; calling the resolver with a task returns an ``Executable`` (dispatch is by
``task.compute_key``, never by task id); ``Executable.launch(ctx)`` enqueues the task's
work on ``ctx.stream`` using only the tensors in ``ctx``. See docs/task_contract.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from dataflow.schema import Task


@attrs.frozen
class LaunchContext:
    """Everything an executable may touch while it runs one task.

    ``inputs``, ``mutates`` and ``outputs`` are typed tensor views (built from each
    object's ``TensorMeta``; a uint8 view of its bytes when it has none), in the task's
    declaration order. Outputs hold garbage until written; mutates are changed in place.
    ``values`` are per-run values (step number, learning rate, ...) given to
    ``Engine.run`` (``RunValues``: a name the run was not given raises
    ``MissingValueError``, naming the value and the task). ``stream`` is the CUDA stream to enqueue on (None on CPU).
    ``workspace`` is a flat uint8 tensor of exactly ``task.workspace_bytes`` (None when
    that is 0): the only scratch memory a task may use beyond its objects; on CUDA it lies
    in the planned arena, so a kernel that allocates elsewhere breaks the budget.
    """

    task: Task
    device: str
    stream: Any
    inputs: tuple[Any, ...]
    mutates: tuple[Any, ...]
    outputs: tuple[Any, ...]
    values: Mapping[str, Any] = attrs.field(factory=dict)
    workspace: Any = None


class MissingValueError(KeyError):
    """A task read a per-run value that the run was not given."""

    def __init__(self, name: str, task_id: str, given: tuple[str, ...]) -> None:
        self.name, self.task_id, self.given = name, task_id, given
        super().__init__(name)

    def __str__(self) -> str:
        return (
            f"task {self.task_id!r} reads the per-run value {self.name!r}, which this run was "
            f"not given (given: {', '.join(self.given) or 'none'}); pass it with "
            f"Engine.run(values={{{self.name!r}: ...}}) or dataflow trace --value "
            f"{self.name}=..."
        )


class RunValues(Mapping[str, Any]):
    """The per-run values as one task sees them (``LaunchContext.values``): a read-only
    mapping whose missing name raises ``MissingValueError`` naming the value and the task
    (``get`` and ``in`` work as on a dict)."""

    __slots__ = ("_values", "_task_id")

    def __init__(self, values: Mapping[str, Any], task_id: str) -> None:
        self._values, self._task_id = values, task_id

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise MissingValueError(name, self._task_id, tuple(sorted(self._values))) from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"RunValues({dict(self._values)!r}, task={self._task_id!r})"


@runtime_checkable
class Executable(Protocol):
    """One task's work. ``launch`` only enqueues work on ``ctx.stream``."""

    def launch(self, ctx: LaunchContext) -> None: ...


@runtime_checkable
class Resolver(Protocol):
    """Turns a task into its executable; raises ``KeyError`` for an unknown compute key."""

    def __call__(self, task: Task) -> Executable: ...


class ResolverError(LookupError):
    """A task's compute key has no executable in the chosen resolver."""

    def __init__(self, task: Task, resolver: str, reason: str) -> None:
        self.task_id, self.compute_key, self.resolver = task.id, task.compute_key, resolver
        super().__init__(
            f"task {task.id!r}: resolver {resolver!r} cannot run compute key "
            f"{task.compute_key!r}: {reason}"
        )


def resolve_all(tasks: tuple[Task, ...], resolver: Resolver, name: str) -> list[Executable]:
    """Resolve every task at load time, so an unknown key fails before anything runs."""
    executables = []
    for task in tasks:
        try:
            executable = resolver(task)
        except KeyError as exc:
            raise ResolverError(task, name, f"unknown key ({exc})") from None
        if not isinstance(executable, Executable):
            raise ResolverError(
                task, name, f"returned {type(executable).__name__}, not an Executable"
            )
        executables.append(executable)
    return executables


class DictResolver:
    """A resolver from a mapping ``compute_key -> factory(task) -> Executable``.

    The simplest way for a package to provide executables; ``name`` appears in errors.
    """

    def __init__(self, name: str, factories: Mapping[str, Any]) -> None:
        self.name = name
        self._factories = dict(factories)

    def __call__(self, task: Task) -> Executable:
        try:
            factory = self._factories[task.compute_key]
        except KeyError:
            known = ", ".join(sorted(self._factories)) or "none"
            raise KeyError(f"known keys: {known}") from None
        return factory(task)
