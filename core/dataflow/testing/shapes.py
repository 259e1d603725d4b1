"""Seeded generators of bare chains of several shapes, for planner tests and benchmarks.

Each takes a ``random.Random`` (so a seed gives the same chain on every machine and
Python version) and returns a bare Program with final locations:

- ``training``: a training step (``chains.training_chain``: forward, fused head, backward
  with saved activations, optimizer over weights and optimizer state that start and end
  slow, gradient-accumulation rounds; everything that exists at start starts slow, the
  embedding and the first batch included, and weights and optimizer state are persistent) whose task costs are drawn so that, per phase, the
  transfers the step needs fit under its compute (``compute_ratio >= 1``);
- ``training_linkbound``: the same with costs drawn so the optimizer phase is link-bound;
- ``tied_embedding``: a training step shaped like a small language model's lowering: a
  large embedding tied to the head, and a link-bound forward pass;
- ``streaming``: weight streaming: every layer's weights start slow and are read once per
  pass (decode steps or micro-batches), a per-layer cache is created in the first pass
  and mutated by the later ones;
- ``random_chain``: objects of log-uniform sizes used again after random gaps, some
  mutated, some outputs, random final locations, random costs and links.

And three small hand-written chains (``tiny_training``, ``tiny_streaming``,
``mutate_and_reuse``) for golden plans and unit tests.

No hypothesis, no torch.
"""

from __future__ import annotations

import random

import attrs

from dataflow.schema import Link, Links, Location, Obj, Program, Role, Task
from dataflow.testing.chains import training_chain

MiB = 2**20
#: 25 GB/s and 10 µs each way: PCIe Gen4 x16 in practice.
PCIE = Links(h2d=Link(25_000.0, 10.0), d2h=Link(25_000.0, 10.0))


def _us(size_bytes: int, link: Link = PCIE.h2d) -> float:
    return link.transfer_us(size_bytes)


def training(
    rng: random.Random,
    *,
    layers: int | None = None,
    rounds: int | None = None,
    compute_ratio: float = 1.5,
) -> Program:
    """A training step whose every phase has at least ``compute_ratio`` times the compute
    its own transfers need (weights and activations in forward and backward; optimizer
    state, weights and gradients in the optimizer)."""
    layers = layers if layers is not None else rng.randint(4, 24)
    rounds = rounds if rounds is not None else rng.randint(1, 3)
    weight = rng.choice([4, 8, 16, 32]) * MiB
    activation = rng.choice([1, 2, 4, 8]) * MiB
    opt_state = weight * rng.choice([2, 4])
    ratio = compute_ratio * rng.uniform(1.0, 3.0)
    fwd_us = ratio * (_us(weight) + 2 * _us(activation))
    bwd_us = 2 * fwd_us
    opt_us = ratio * (_us(opt_state) + 2 * _us(weight))
    program = training_chain(
        layers,
        rounds,
        weight_bytes=weight,
        opt_state_bytes=opt_state,
        grad_bytes=weight,
        activation_bytes=activation,
        fwd_us=round(fwd_us, 1),
        bwd_us=round(bwd_us, 1),
        opt_us=round(opt_us, 1),
        links=PCIE,
    )
    return _from_slow(attrs.evolve(program, name=f"training-{layers}x{rounds}"))


def _from_slow(program: Program) -> Program:
    """The step as a user writes it: everything that exists at start (weights, optimizer
    state, the data) starts in slow memory (the prologue fetches what the first task
    needs), and weights and optimizer state are persistent (for cyclic plans)."""
    objects = tuple(
        attrs.evolve(obj, location=Location.SLOW) if program.exists_at_start(obj.id) else obj
        for obj in program.objects
    )
    persistent = tuple(
        obj.id for obj in program.objects if obj.role in (Role.PARAM, Role.OPT_STATE)
    )
    return attrs.evolve(program, objects=objects, persistent=persistent)


def training_linkbound(
    rng: random.Random, *, layers: int | None = None, rounds: int | None = None
) -> Program:
    """A training step whose optimizer phase is link-bound: its tasks cost 4-10 times less
    than in ``training``, so the optimizer state takes longer to cross the link than to
    update."""
    program = training(rng, layers=layers, rounds=rounds)
    tasks = tuple(
        attrs.evolve(task, cost_us=round(task.cost_us / rng.uniform(4.0, 10.0), 1))
        if task.kind == "opt"
        else task
        for task in program.tasks
    )
    return attrs.evolve(program, tasks=tasks, name=program.name.replace("training", "linkbound"))


def tied_embedding(
    rng: random.Random, *, layers: int | None = None, rounds: int | None = None
) -> Program:
    """A training step shaped like a small-model lowering: the embedding is tied to the
    head (the head reads it and writes its gradient too) and is 16-64 times a layer's
    weights, and the forward pass is link-bound (its saved activations take longer to
    cross the link than to compute), as in a language model with a large vocabulary."""
    layers = layers if layers is not None else rng.randint(6, 24)
    rounds = rounds if rounds is not None else rng.randint(1, 3)
    weight = rng.choice([2, 4, 8]) * MiB
    scale = rng.choice([16, 32, 64])
    activation = rng.choice([4, 8, 16]) * MiB
    fwd_us = round(_us(weight) * rng.uniform(0.1, 0.5), 1)
    program = training_chain(
        layers,
        rounds,
        weight_bytes=weight,
        opt_state_bytes=2 * weight,
        grad_bytes=weight,
        activation_bytes=activation,
        fwd_us=fwd_us,
        bwd_us=2 * fwd_us,
        opt_us=round(_us(3 * weight) * rng.uniform(0.2, 1.0), 1),
        links=PCIE,
    )
    big = {"W_emb", "dW_emb", "O_emb"}
    objects = [
        attrs.evolve(obj, size_bytes=obj.size_bytes * scale) if obj.id in big else obj
        for obj in program.objects
    ]
    tasks = []
    heads = 0  # the chain runs its rounds in order: its first head task is round 0's
    for task in program.tasks:
        if task.kind == "head":  # tied: the head reads the embedding, adds to its gradient
            round_0, heads = heads == 0, heads + 1
            grads = (
                {"outputs": (*task.outputs, "dW_emb")}
                if round_0
                else {"mutates": (*task.mutates, "dW_emb")}
            )
            task = attrs.evolve(task, inputs=(*task.inputs, "W_emb"), **grads)
        elif task.kind == "embed_bwd" and "dW_emb" in task.outputs:
            outputs = tuple(obj for obj in task.outputs if obj != "dW_emb")
            task = attrs.evolve(task, outputs=outputs, mutates=(*task.mutates, "dW_emb"))
        tasks.append(task)
    return _from_slow(
        attrs.evolve(
            program, objects=objects, tasks=tasks, name=f"tied-{layers}x{rounds}", metadata={}
        )
    )


def streaming(
    rng: random.Random, *, layers: int | None = None, passes: int | None = None
) -> Program:
    """Weight streaming over ``passes`` passes: an embedding task turns ``x_p`` into
    ``h_p_0``; then pass ``p`` of layer ``i`` reads ``W_i`` and ``h_p_i``, writes
    ``h_p_{i+1}`` and creates (pass 0) or mutates its cache ``C_i``."""
    layers = layers if layers is not None else rng.randint(6, 40)
    passes = passes if passes is not None else rng.randint(1, 4)
    weight = rng.choice([8, 16, 32, 64]) * MiB
    cache = rng.choice([1, 2, 4]) * MiB
    hidden = rng.choice([1, 2]) * MiB
    layer_us = round(_us(weight) * rng.uniform(1.1, 3.0), 1)
    objects = [Obj(f"W_{i}", weight, Role.PARAM, Location.SLOW) for i in range(layers)]
    objects += [Obj(f"C_{i}", cache, Role.AUX) for i in range(layers)]
    objects += [Obj(f"x_{p}", hidden, Role.DATA, Location.FAST) for p in range(passes)]
    objects += [
        Obj(f"h_{p}_{i}", hidden, Role.ACTIVATION) for p in range(passes) for i in range(layers + 1)
    ]
    tasks = []
    for p in range(passes):
        # The embedding: it gives the first layer's weights time to arrive.
        tasks.append(
            Task(
                f"embed_{p}",
                "embed",
                "embed",
                inputs=(f"x_{p}",),
                outputs=(f"h_{p}_0",),
                cost_us=round(layer_us / 4, 1),
            )
        )
        for i in range(layers):
            cache_use = (
                {"outputs": (f"h_{p}_{i + 1}", f"C_{i}")}
                if p == 0
                else {
                    "outputs": (f"h_{p}_{i + 1}",),
                    "mutates": (f"C_{i}",),
                }
            )
            tasks.append(
                Task(
                    f"layer_{p}_{i}",
                    "layer",
                    "layer",
                    inputs=(f"h_{p}_{i}", f"W_{i}"),
                    cost_us=layer_us,
                    **cache_use,
                )
            )
    finals = {f"W_{i}": Location.SLOW for i in range(layers)}
    finals.update({f"h_{p}_{layers}": Location.FAST for p in range(passes)})
    return Program(
        name=f"streaming-{layers}x{passes}",
        objects=objects,
        tasks=tasks,
        final_locations=finals,
        links=PCIE,
    )


def random_chain(rng: random.Random, *, tasks: int | None = None) -> Program:
    """A random chain: objects used again after random gaps, some mutated, some created."""
    count = tasks if tasks is not None else rng.randint(10, 120)
    link_bw = rng.choice([5_000.0, 25_000.0, 50_000.0])
    links = Links(h2d=Link(link_bw, rng.choice([0.0, 10.0])), d2h=Link(link_bw, 10.0))

    def size() -> int:
        return int(2 ** rng.uniform(16, 26))

    objects: list[Obj] = []
    alive: list[str] = []
    chain: list[Task] = []
    for index in range(count):
        while len(alive) < 3 or rng.random() < 0.15:
            obj = Obj(
                f"o{len(objects)}",
                size(),
                Role.DATA,
                Location.FAST if index == 0 else Location.SLOW,
            )
            objects.append(obj)
            alive.append(obj.id)
        recent = alive[-8:]
        uses = rng.sample(recent, rng.randint(1, min(3, len(recent))))
        if rng.random() < 0.3:
            uses.append(rng.choice(alive))
        uses = list(dict.fromkeys(uses))
        mutated = rng.randint(0, len(uses)) if rng.random() < 0.4 else 0
        outputs = [f"t{index}_out{k}" for k in range(rng.choice([0, 1, 1, 2]))]
        objects += [Obj(out, size(), Role.ACTIVATION) for out in outputs]
        alive += outputs
        if len(alive) > 24 and rng.random() < 0.5:
            alive.pop(rng.randrange(len(alive) - 4))
        busiest = max((o.size_bytes for o in objects if o.id in uses), default=0)
        chain.append(
            Task(
                f"t{index}",
                "k",
                "k",
                inputs=uses[mutated:],
                mutates=uses[:mutated],
                outputs=outputs,
                workspace_bytes=rng.choice([0, 0, size()]),
                cost_us=round(rng.uniform(0.2, 3.0) * links.h2d.transfer_us(busiest), 1),
            )
        )
    first = set(chain[0].uses)
    objects = [attrs.evolve(o, location=Location.FAST) if o.id in first else o for o in objects]
    used = sorted({obj for task in chain for obj in task.uses})
    finals = {
        obj: rng.choice([Location.FAST, Location.SLOW])
        for obj in rng.sample(used, min(len(used), rng.randint(0, 4)))
    }
    return Program(
        name=f"random-{count}", objects=objects, tasks=chain, final_locations=finals, links=links
    )


# -- small hand-written chains (golden plans, unit tests) ----------------------------------

#: 10 GB/s with 5 µs latency: a 4 MiB object takes about 420 µs, the order of a task in the
#: small chains below, so where a prefetch goes matters.
SMALL_LINKS = Links(h2d=Link(10_000.0, 5.0), d2h=Link(10_000.0, 5.0))


def tiny_training() -> Program:
    """Two layers, forward then backward then optimizer: every kind of object once."""
    objects = [
        Obj("x", 1 * MiB, "data", "fast"),
        Obj("W0", 4 * MiB, "param", "slow"),
        Obj("W1", 4 * MiB, "param", "slow"),
        Obj("O0", 8 * MiB, "opt_state", "slow"),
        Obj("O1", 8 * MiB, "opt_state", "slow"),
        Obj("h0", 2 * MiB, "activation"),
        Obj("h1", 2 * MiB, "activation"),
        Obj("g1", 2 * MiB, "activation"),
        Obj("g0", 2 * MiB, "activation"),
        Obj("dW1", 4 * MiB, "grad"),
        Obj("dW0", 4 * MiB, "grad"),
    ]
    tasks = [
        Task("embed", "embed", "embed", inputs=("x",), outputs=("h0",), cost_us=200.0),
        Task("fwd0", "fwd", "layer", inputs=("h0", "W0"), outputs=("h1",), cost_us=400.0),
        Task("head", "head", "head", inputs=("h1", "W1"), outputs=("g1",), cost_us=600.0),
        Task(
            "bwd1", "bwd", "layer_bwd", inputs=("g1", "h1", "W1"), outputs=("dW1",), cost_us=800.0
        ),
        Task(
            "bwd0",
            "bwd",
            "layer_bwd",
            inputs=("g1", "h0", "W0"),
            outputs=("g0", "dW0"),
            cost_us=800.0,
        ),
        Task("opt0", "opt", "adamw", inputs=("dW0",), mutates=("W0", "O0"), cost_us=700.0),
        Task("opt1", "opt", "adamw", inputs=("dW1",), mutates=("W1", "O1"), cost_us=700.0),
    ]
    finals = {name: Location.SLOW for name in ("W0", "W1", "O0", "O1")}
    return Program("tiny-training", objects, tasks, final_locations=finals, links=SMALL_LINKS)


def tiny_streaming(layers: int = 4) -> Program:
    """Weights streamed through a forward pass; the output stays in fast memory."""
    objects = [Obj("x", 1 * MiB, "data", "fast")]
    objects += [Obj(f"W{i}", 8 * MiB, "param", "slow") for i in range(layers)]
    objects += [Obj(f"h{i}", 1 * MiB, "activation") for i in range(layers + 1)]
    tasks = [Task("embed", "embed", "embed", inputs=("x",), outputs=("h0",), cost_us=300.0)]
    tasks += [
        Task(
            f"layer{i}",
            "layer",
            "layer",
            inputs=(f"h{i}", f"W{i}"),
            outputs=(f"h{i + 1}",),
            cost_us=500.0,
        )
        for i in range(layers)
    ]
    finals = {f"h{layers}": Location.FAST, **{f"W{i}": Location.SLOW for i in range(layers)}}
    return Program(
        f"tiny-streaming-{layers}", objects, tasks, final_locations=finals, links=SMALL_LINKS
    )


def mutate_and_reuse() -> Program:
    """An accumulator that starts fast, is mutated, waits through a big temporary, is read
    again and must end slow; a buffer that starts fast and must end fast."""
    objects = [
        Obj("acc", 4 * MiB, "aux", "fast"),
        Obj("keep", 2 * MiB, "aux", "fast"),
        Obj("a", 1 * MiB, "data", "fast"),
        Obj("big", 12 * MiB, "scratch"),
        Obj("out", 1 * MiB, "output"),
    ]
    tasks = [
        Task("add", "k", "add", inputs=("a",), mutates=("acc",), cost_us=300.0),
        Task("make", "k", "make", inputs=("a",), outputs=("big",), cost_us=900.0),
        Task("use", "k", "use", inputs=("big",), cost_us=900.0, workspace_bytes=1 * MiB),
        Task("read", "k", "read", inputs=("acc", "keep"), outputs=("out",), cost_us=300.0),
    ]
    finals = {"acc": Location.SLOW, "keep": Location.FAST, "out": Location.FAST}
    return Program("mutate-and-reuse", objects, tasks, final_locations=finals, links=SMALL_LINKS)


#: shape name -> generator
SHAPES = {
    "training": training,
    "training-linkbound": training_linkbound,
    "tied-embedding": tied_embedding,
    "streaming": streaming,
    "random": random_chain,
}
