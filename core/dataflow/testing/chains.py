"""Ready-made Programs for tests and benchmarks (no hypothesis, no torch).

- ``training_chain``: a bare training step lowered the way the training plugin will
  (embed, per-layer forward, fused head, per-layer backward, embed backward, optimizer),
  with gradient-accumulation rounds; everything but the first data batch starts slow.
- ``stream_all``: a naive annotator that streams every object: it drops an object after
  a use when its next use is at least ``min_gap_tasks`` later (offload if dirty, release if
  clean) and prefetches it ``lookahead_tasks`` before it is needed. It ignores the budget:
  it is a test fixture that produces realistic, coherent directives, not a planner.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from dataflow.schema import Link, Links, Location, Obj, Program, Role, Task

MiB = 2**20


def training_chain(
    layers: int,
    rounds: int = 1,
    *,
    weight_bytes: int = 16 * MiB,
    opt_state_bytes: int = 64 * MiB,
    grad_bytes: int = 16 * MiB,
    activation_bytes: int = 8 * MiB,
    data_bytes: int = 64 * 1024,
    fwd_us: float = 1000.0,
    bwd_us: float = 2000.0,
    opt_us: float = 400.0,
    links: Links | None = None,
) -> Program:
    """One training step: ``rounds * (2 * layers + 3) + layers + 2`` tasks, no directives.

    Ids follow the training plugin: tasks ``{kind}_{step}_{round}_{layer}``, objects
    ``W_i``, ``O_i``, ``dW_i``, hidden states ``y_0_{round}_{i}``, gradients
    ``dy_0_{round}_{i}``, data ``x_{round}``. Round 0 creates each ``dW_i``; later rounds
    mutate it. Weights and optimizer state end in slow memory.
    """
    objects: list[Obj] = []
    tasks: list[Task] = []
    names = [*(str(i) for i in range(layers)), "emb", "head"]
    for name in names:
        # The embedding is used by the very first task: nothing could prefetch it in time.
        where = Location.FAST if name == "emb" else Location.SLOW
        objects += [
            Obj(f"W_{name}", weight_bytes, Role.PARAM, where),
            Obj(f"O_{name}", opt_state_bytes, Role.OPT_STATE, Location.SLOW),
            Obj(f"dW_{name}", grad_bytes, Role.GRAD),
        ]
    for r in range(rounds):
        where = Location.FAST if r == 0 else Location.SLOW
        objects.append(Obj(f"x_{r}", data_bytes, Role.DATA, where))
        objects += [
            Obj(f"y_0_{r}_{i}", activation_bytes, Role.ACTIVATION) for i in range(layers + 1)
        ]
        objects += [
            Obj(f"dy_0_{r}_{i}", activation_bytes, Role.ACTIVATION) for i in range(layers + 1)
        ]

    def grad(r: int, name: str) -> dict[str, tuple[str, ...]]:
        return {"outputs": (f"dW_{name}",)} if r == 0 else {"mutates": (f"dW_{name}",)}

    def task(kind: str, r: int, layer: int, cost_us: float, **fields) -> Task:
        merged: dict[str, tuple[str, ...]] = {}
        for key, value in fields.items():
            merged[key] = merged.get(key, ()) + tuple(value)
        return Task(f"{kind}_0_{r}_{layer}", kind, kind, cost_us=cost_us, **merged)

    for r in range(rounds):
        y = [f"y_0_{r}_{i}" for i in range(layers + 1)]
        dy = [f"dy_0_{r}_{i}" for i in range(layers + 1)]
        tasks.append(task("embed", r, 0, fwd_us / 4, inputs=(f"x_{r}", "W_emb"), outputs=(y[0],)))
        for i in range(layers):
            tasks.append(task("fwd", r, i, fwd_us, inputs=(y[i], f"W_{i}"), outputs=(y[i + 1],)))
        head_grad = grad(r, "head")
        tasks.append(
            task(
                "head",
                r,
                layers,
                3 * fwd_us,
                inputs=(y[layers], "W_head"),
                outputs=(dy[layers], *head_grad.get("outputs", ())),
                mutates=head_grad.get("mutates", ()),
            )
        )
        for i in reversed(range(layers)):
            layer_grad = grad(r, str(i))
            tasks.append(
                task(
                    "bwd",
                    r,
                    i,
                    bwd_us,
                    inputs=(dy[i + 1], y[i], f"W_{i}"),
                    outputs=(dy[i], *layer_grad.get("outputs", ())),
                    mutates=layer_grad.get("mutates", ()),
                )
            )
        emb_grad = grad(r, "emb")
        tasks.append(
            task(
                "embed_bwd",
                r,
                0,
                fwd_us / 4,
                inputs=(dy[0], f"x_{r}"),
                outputs=emb_grad.get("outputs", ()),
                mutates=emb_grad.get("mutates", ()),
            )
        )
    for position, name in enumerate(names):
        tasks.append(
            Task(
                f"opt_0_0_{position}",
                "opt",
                "adamw",
                inputs=(f"dW_{name}",),
                mutates=(f"W_{name}", f"O_{name}"),
                cost_us=opt_us,
            )
        )
    finals = {f"{kind}_{name}": Location.SLOW for name in names for kind in ("W", "O")}
    return Program(
        name=f"training-chain-{layers}x{rounds}",
        objects=objects,
        tasks=tasks,
        final_locations=finals,
        links=links or Links(h2d=Link(25_000.0, 10.0), d2h=Link(25_000.0, 10.0)),
        metadata={"made_by": "dataflow.testing.chains.training_chain"},
    )


def stream_all(
    program: Program,
    *,
    lookahead_tasks: int = 2,
    min_gap_tasks: int = 2,
    evict: Callable[[str, int, int], bool] | None = None,
) -> Program:
    """``program`` with every directive rewritten so objects stay in fast memory only
    around their uses (see the module docstring).

    ``evict(obj_id, use, next_use)`` (default: always) decides whether an object leaves
    fast memory between two uses at least ``min_gap_tasks`` apart. An object that starts
    slow and is first used by task 0 cannot be prefetched in time; the result then fails
    to simulate (not-resident), as it should.
    """
    if min_gap_tasks < 2 or lookahead_tasks < 1:
        raise ValueError("min_gap_tasks must be >= 2 and lookahead_tasks >= 1")
    uses: dict[str, list[int]] = {obj.id: [] for obj in program.objects}
    for index, task in enumerate(program.tasks):
        for obj in task.uses:
            uses[obj].append(index)
    count = len(program.tasks)
    releases: list[list[str]] = [[] for _ in range(count)]
    offloads: list[list[str]] = [[] for _ in range(count)]
    prefetches: list[list[tuple[int, str]]] = [[] for _ in range(count)]  # (use, obj)
    for obj in program.objects:
        times = uses[obj.id]
        if not times:
            continue
        created = not program.exists_at_start(obj.id)
        resident = created or obj.location is Location.FAST
        dirty = created or obj.location is Location.FAST  # no current slow copy
        last_drop = -1
        for position, use in enumerate(times):
            if not resident:
                at = max(use - lookahead_tasks, last_drop + 1, 0)
                if at < use:
                    prefetches[at].append((use, obj.id))
                resident, dirty = True, False
            task = program.tasks[use]
            if obj.id in task.mutates or obj.id in task.outputs:
                dirty = True
            following = times[position + 1] if position + 1 < len(times) else None
            if following is None:
                final = program.final_locations.get(obj.id)
                if final is Location.SLOW and dirty:
                    offloads[use].append(obj.id)
                elif final is not Location.FAST:
                    releases[use].append(obj.id)
            elif following - use >= min_gap_tasks and (
                evict is None or evict(obj.id, use, following)
            ):
                (offloads if dirty else releases)[use].append(obj.id)
                resident, dirty, last_drop = False, False, use
    tasks = [
        attrs.evolve(
            task,
            releases=tuple(releases[index]),
            offloads=tuple(offloads[index]),
            prefetches=tuple(obj for _, obj in sorted(prefetches[index])),
        )
        for index, task in enumerate(program.tasks)
    ]
    return attrs.evolve(program, tasks=tasks)
