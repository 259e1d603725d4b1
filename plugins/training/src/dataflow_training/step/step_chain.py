"""``StepChain``: the chain of one training step while ``lowering.lower`` builds it, and
the edits made to it once its rounds are lowered.

``lower`` adds objects and tasks to a ``StepChain`` round by round; ``StepChain.task``
makes a task and its typed slot (``step.TaskSlot``) from one set of roles, so the two
cannot disagree. Then, in this order, the chain may be put in layer order
(``layer_major``), get one ``allreduce`` and one ``gnorm`` task right after the task that
completes each trainable group's last-round gradient (``add_allreduces``,
``add_grad_norms``), and, once the optimizer tasks are added, have each update moved to
right after the last use of its group (``updates_after_last_use``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from dataflow import Obj, Resource, Role, Task, TensorMeta
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.family import Work
from dataflow_training.step.keys import GRAD_ALLREDUCE_KEY, GRAD_NORM_KEY
from dataflow_training.step.layout import ROLES, PackedObject, TaskSlot


def group_name(layer: str, group: str) -> str:
    """``3`` for a layer's main group, ``3.experts`` for a named one."""
    return f"{layer}.{group}" if group else layer


def group_object(prefix: str, layer: str, group: str) -> str:
    """``W_3`` for a layer's main group, ``W_3.experts`` for a named one."""
    return f"{prefix}_{group_name(layer, group)}"


class StepChain:
    """The objects (with the packed ones' layouts), tasks and task slots of step ``step``
    of ``family``, in the order they are added. ``kinds`` is each layer's kind (a block
    task's params name it); ``cost`` prices tasks by their work."""

    def __init__(
        self,
        family: str,
        step: int,
        train: TrainConfig,
        kinds: Mapping[str, str],
        cost: RooflineCost,
    ) -> None:
        self.family, self.step, self.train = family, step, train
        self.kinds, self.cost = kinds, cost
        self.packed: dict[str, PackedObject] = {}
        self.objects: list[Obj] = []
        self.tasks: list[Task] = []
        self.slots: dict[str, TaskSlot] = {}

    def add_packed(self, obj: PackedObject, role: Role, location: str = "slow") -> None:
        """A packed object (its layout kept for the step layout) that exists at the start
        in ``location``, or (an activation) that a task creates."""
        self.packed[obj.id] = obj
        self.objects.append(Obj(obj.id, obj.layout.size_bytes, role, location))

    def priced(self, work: Work, weight_bytes: float) -> float:
        """``work`` plus reading ``weight_bytes``, in µs."""
        return self.cost.cost_us(work.flops, work.bytes + weight_bytes, max(1, work.kernels))

    def task(self, kind: str, r: int, layer: str, key: str, cost_us: float, **roles: Any) -> None:
        """Add task ``{kind}_{step}_{r}_{layer[.group]}``: ``roles`` holds its ``inputs``,
        ``mutates`` and ``outputs`` by role, and ``group`` (an optimizer or gradient
        task's parameter group), ``save`` (a forward that writes ``A``), ``zero_aux`` (the
        step's first forward to touch its Aux object) and ``partial`` (the partial save a
        ``rec`` task completes)."""
        group = roles.pop("group", "")
        save = roles.pop("save", True)
        zero_aux = roles.pop("zero_aux", False)
        partial_name = roles.pop("partial", None)
        shard = roles.pop("shard", None)
        slot = TaskSlot(
            f"{kind}_{self.step}_{r}_{group_name(layer, group)}",
            kind,
            layer,
            r,
            key,
            roles.get("inputs", {}),
            roles.get("mutates", {}),
            roles.get("outputs", {}),
            group,
            save,
        )
        params: dict[str, Any] = {
            "family": self.family,
            "step": self.step,
            "round": r,
            "layer": layer,
        }
        if kind in ("fwd", "rec", "bwd", "efwd", "ebwd"):
            params["kind"] = self.kinds[layer]
        if shard is not None:  # an expert shard's task: its index and the shard count
            params["shard"], params["shards"] = shard
        if kind in ("fwd", "rec", "bwd") and self.train.block_row_groups > 1:
            params["row_groups"] = self.train.block_row_groups  # another workspace
        if kind == "fwd":
            params["save"] = save
            if zero_aux:
                params["zero_aux"] = True
        if partial_name is not None:
            params["partial"] = partial_name  # the partial save a rec task completes
        if group:
            params["group"] = group
        if kind == "head":
            params["chunk_tokens"] = self.train.chunk_tokens
            if self.train.head_vocab_tiles:
                params["vocab_tiles"] = True
            if self.train.head_accumulate != "float32":  # another workspace: another profile
                params["accumulate"] = self.train.head_accumulate
        self.slots[slot.id] = slot
        self.tasks.append(
            Task(
                slot.id,
                kind,
                key,
                params=params,
                inputs=_flat(slot.inputs),
                mutates=_flat(slot.mutates),
                outputs=_flat(slot.outputs),
                cost_us=cost_us,
            )
        )


def add_grad_norms(chain: StepChain, grads: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """With ``train.measures_grad_norm``: one ``gnorm`` task per trainable group, placed
    right after the task that completes the group's last-round gradient, writing the
    group's squared norm ``gn_<step>_<layer>[.<group>]`` (float32). Returns the ``gn`` ids
    in layer order (every optimizer task sums them in that order), empty when the step
    measures no norm."""
    train, packed = chain.train, chain.packed
    if not train.measures_grad_norm:
        return ()
    norms = []

    def make(layer: str, dw: str) -> None:
        group = packed[dw].group
        gn = group_object(f"gn_{chain.step}", layer, group)
        chain.objects.append(Obj(gn, 4, Role.OUTPUT, tensor=TensorMeta("float32", ())))
        size = packed[dw].layout.size_bytes
        chain.task(
            "gnorm",
            train.rounds - 1,
            layer,
            GRAD_NORM_KEY,
            chain.cost.cost_us(2 * size // 4, size),
            inputs={"grad": (dw,)},
            outputs={"grad_norm": (gn,)},
            group=group,
        )
        norms.append(gn)

    _after_last_grad(chain, grads, make)
    return tuple(norms)


def add_allreduces(chain: StepChain, share: float, grads: Mapping[str, tuple[str, ...]]) -> None:
    """One ``allreduce`` task per trainable group (``lower``'s ``grad_share``), mutating
    the group's ``dW``, on the collective link (no compute cost: the link prices it by
    the gradient's size); its ``share`` is in the task's params."""

    def make(layer: str, dw: str) -> None:
        chain.task(
            "allreduce",
            chain.train.rounds - 1,
            layer,
            GRAD_ALLREDUCE_KEY,
            0.0,
            mutates={"grad": (dw,)},
            group=chain.packed[dw].group,
        )
        tasks = chain.tasks
        tasks[-1] = attrs.evolve(
            tasks[-1],
            params={**tasks[-1].params, "share": share},
            resource=Resource.COLLECTIVE,
        )

    _after_last_grad(chain, grads, make)


def _after_last_grad(
    chain: StepChain,
    grads: Mapping[str, tuple[str, ...]],
    make: Callable[[str, str], None],
) -> None:
    """For every trainable group's ``dW``, ``make(layer, dw)`` adds one task (through
    ``chain.task``), which is moved to right after the task that completes ``dW``."""
    tasks = chain.tasks
    after: dict[int, list[Task]] = {}
    for layer, dws in grads.items():
        for dw in dws:
            done = max(i for i, t in enumerate(tasks) if dw in t.outputs or dw in t.mutates)
            make(layer, dw)
            after.setdefault(done, []).append(tasks.pop())
    ordered = list(tasks)
    tasks.clear()
    for i, t in enumerate(ordered):
        tasks += [t, *after.get(i, ())]


def updates_after_last_use(tasks: list[Task]) -> list[Task]:
    """The chain with each optimizer task moved to right after the last other task that
    touches its group's weights or gradient (the last round's backward of its layer; for
    weights two layers share, the later one's), the updates of one place in their order.

    The update then finds the group's weights and gradient still in fast memory and frees
    them (and its optimizer state) while the layers below run backward, where at the end
    of the step every group's weights, gradient and state come back over the link with no
    compute left to hide behind (session 19, OLMoE 1B-7B at 16 GiB by layer: 0.76 s of
    its 6.29 s simulated step was compute waiting for the experts' 3.2 GB a layer). Not
    with a clip (every update reads every group's norm) nor an all-reduce (the update
    would wait on the collective); ``TrainConfig.updates`` says when."""
    updates = [t for t in tasks if t.kind == "opt"]
    chain = [t for t in tasks if t.kind != "opt"]
    after: dict[int, list[Task]] = {}
    for update in updates:
        own = set(update.mutates) | set(update.inputs)
        last = max(i for i, t in enumerate(chain) if own & {*t.inputs, *t.mutates, *t.outputs})
        after.setdefault(last, []).append(update)
    return [u for i, t in enumerate(chain) for u in (t, *after.get(i, ()))]


def layer_major(tasks: list[Task], layer_names: list[str], group: int) -> list[Task]:
    """The round-major chain of the rounds' tasks, reordered layer by layer within each
    group of ``group`` consecutive rounds (the groups one after another): the group's
    forwards (embed, blocks, head) by layer position then round, then its backwards (a
    block's recompute right before its backward) by layer position descending then round.

    Every dependency still points backwards: a round's forward reads the layer below's
    output for that round, a backward the layer above's input gradient, and a gradient is
    created by round 0's task of its layer and accumulated by the later rounds' in order."""
    position = {name: i for i, name in enumerate(layer_names)}
    backward = {"rec": 0, "ebwd": 1, "bwd": 1, "embbwd": 1}

    def key(t: Task) -> tuple[int, int, int, int, int]:
        place, r = position[t.params["layer"]], t.params["round"]
        if t.kind in ("embed", "fwd", "efwd", "head"):
            return (r // group, 0, place, r, 0)
        return (r // group, 1, len(layer_names) - place, r, backward[t.kind])

    return sorted(tasks, key=key)


def _flat(roles: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A task's objects in the fixed role order (the order of ``step.ROLES``)."""
    return tuple(obj for role in ROLES for obj in roles.get(role, ()))
