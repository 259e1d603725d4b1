"""``predict``: what a grid of training steps would do, from the simulator alone.

A **cell** is a preset trained with ``t_round`` tokens a round (``batch = t_round /
seq_len``), ``rounds = tokens_step / t_round`` accumulation rounds, inside a fast budget
and, optionally, a backing (pinned host) budget. Each cell is lowered, priced (by the
hardware entry's roofline, or by the profiling pass through its disk cache with
``measured``), planned (the recompute planner, or PressureFit alone) as the steady-state
cycle a run plans (weights and optimizer state homed where the plan chooses between
steps, as ``TrainingRun`` plans them) and simulated; its row says what one step costs. A cell that cannot run is a row that says why
(``feasible: false`` and ``reason``), never an error.

With ``ranks`` (``predict_fleet``), each cell is also one member of a data-parallel fleet
of that many ranks: every rank runs the cell's step (its rounds, its budget) and the step
ends with the all-reduce of every gradient group on the collective link of the hardware
entry (``HardwareEntry.collective_link`` for that many ranks, within one host or over the
network). The row adds the fleet's tokens/s, how much of the all-reduce the step waited
for (exposed) and how much ran under the backward (hidden), and the scaling efficiency:
the fleet's tokens/s over ``ranks`` times one plain process's (no all-reduce).

A sequence longer than the preset's position table (GPT-2's ``n_positions``) lengthens
the table (an override the row names): the step is then the preset's at that length.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from dataflow import DTYPE_BYTES, PRESSUREFIT, PlanningError, Program, plan
from dataflow_training.plan.compiled_step import running_step
from dataflow_training.plan.hardware import HardwareEntry
from dataflow_training.plan.recompute import (
    MAX_CANDIDATES,
    Rewriter,
    measured_rewriter,
    step_planner,
)
from dataflow_training.step.config import TrainConfig, head_chunk_tokens
from dataflow_training.step.lora import LoraConfig
from dataflow_training.step.lowering import Lowered, lower
from dataflow_training.step.precision import pinned
from dataflow_training.step.precision import precision as precision_policy

#: Config fields under which a family may declare the longest sequence its model takes.
MAX_SEQ_LEN_FIELDS = ("max_seq_len", "n_positions", "max_position_embeddings")


@attrs.frozen
class Cell:
    """One point of the grid (sizes in tokens and bytes)."""

    preset: str
    t_round: int
    seq_len: int
    tokens_step: int
    budget_bytes: int
    backing_bytes: int | None = None
    order: str = "round"  # TrainConfig.order
    #: the model's vocabulary where it is not the preset's (``--vocab-size``)
    vocab_size: int | None = None

    @property
    def batch(self) -> int:
        return self.t_round // self.seq_len

    @property
    def rounds(self) -> int:
        return self.tokens_step // self.t_round

    def why_not(self) -> str | None:
        """Why the cell's step does not exist (None: it does)."""
        if self.t_round % self.seq_len:
            return f"T_round {self.t_round} is not a multiple of seq_len {self.seq_len}"
        if self.tokens_step % self.t_round:
            return f"tokens per step {self.tokens_step} is not a multiple of T_round {self.t_round}"
        return None

    def key(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "t_round": self.t_round,
            "seq_len": self.seq_len,
            "batch": self.batch if not self.t_round % self.seq_len else None,
            "rounds": self.rounds if not self.tokens_step % self.t_round else None,
            "budget_bytes": self.budget_bytes,
            "backing_bytes": self.backing_bytes,
            "order": self.order,
            **({"vocab_size": self.vocab_size} if self.vocab_size is not None else {}),
        }


def grid(
    preset: str,
    t_rounds: Sequence[int],
    seq_lens: Sequence[int],
    budgets: Sequence[int],
    tokens_step: int,
    backing_bytes: int | None = None,
    orders: Sequence[str] = ("round",),
    vocab_size: int | None = None,
) -> list[Cell]:
    """Every cell, by sequence length, then T_round, then budget (largest first as given),
    then task order; ``vocab_size``: every cell's model vocabulary (None: the preset's)."""
    return [
        Cell(preset, t_round, seq_len, tokens_step, budget, backing_bytes, order, vocab_size)
        for seq_len in seq_lens
        for t_round in t_rounds
        for budget in budgets
        for order in orders
    ]


@attrs.frozen
class Tuning:
    """What a predicted step trains and with what (``dataflow predict``'s ``--freeze``,
    ``--lora``, ``--optimizer``; ``TrainConfig``'s fields of those names), and how its
    tables and experts are cut (``--vocab-pieces``, ``--expert-shards``: None, the
    search's where it searches, else one piece and the preset's shards)."""

    freeze: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    lora: LoraConfig | None = None
    optimizer: str = "adamw"
    optimizer_args: dict[str, Any] = attrs.field(factory=dict)
    vocab_pieces: int | None = None
    expert_shards: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The model overrides it makes: ``expert_shards`` where given."""
        return {} if self.expert_shards is None else {"expert_shards": self.expert_shards}

    def options_fields(self) -> dict[str, Any]:
        """``TrainOptions``' fields of the same (its ``lora_config`` makes ``lora`` again;
        ``expert_shards`` is an override: ``overrides``)."""
        lora = self.lora
        return {
            "freeze": self.freeze,
            "optimizer": self.optimizer,
            "optimizer_args": self.optimizer_args,
            "lora": lora and lora.rank,
            "lora_alpha": lora and lora.alpha,
            "lora_dropout": lora.dropout if lora else 0.0,
            "lora_targets": lora.targets if lora else (),
            "lora_base": lora and lora.base,
            "vocab_pieces": self.vocab_pieces or 1,
        }

    def fields(self) -> dict[str, Any]:
        """What a row says of it: only what differs from full training by AdamW."""
        found: dict[str, Any] = {}
        if self.freeze:
            found["freeze"] = list(self.freeze)
        if self.lora is not None:
            found["lora"] = self.lora.rank
        if self.optimizer != "adamw" or self.optimizer_args:
            found["optimizer"] = self.optimizer
        if self.vocab_pieces is not None:
            found["vocab_pieces"] = self.vocab_pieces
        return found


def train_config(
    cell: Cell,
    dtype: str = "bf16",
    chunk_tokens: int = 8192,
    vocab: int | None = None,
    states: str = "fp32",
    precision: str | None = None,
    segments: bool = False,
    tuning: Tuning | None = None,
) -> TrainConfig:
    """The training step of a cell: bf16 weights, gradients and activations with float32
    optimizer states by default (``states``: ``config.STATE_DTYPES``; ``precision``, a
    policy of ``step.precision``, replaces the pair), the head ``chunk_tokens`` tokens at
    a time (with ``vocab``: at most the chunk ``head_chunk_tokens`` gives the cell's
    budget); with ``segments`` each round carries its segments (``dataflow train
    --pack-documents``: priced as the dense step's work, its tasks' attention the same
    FLOPs, plus each round's segments object moved like its tokens). ``tuning``: what
    trains and how (default: every parameter, by AdamW)."""
    if vocab is not None:
        chunk_tokens = head_chunk_tokens(cell.budget_bytes, vocab, chunk_tokens)
    policy = pinned(dtype, states) if precision is None else precision_policy(precision)
    tuning = tuning or Tuning()
    return TrainConfig(
        seq_len=cell.seq_len,
        batch=cell.batch,
        rounds=cell.rounds,
        dtype=policy.dtype,
        optimizer=policy.optimizer_policy(tuning.optimizer, tuning.optimizer_args),
        chunk_tokens=min(chunk_tokens, cell.t_round),
        order=cell.order,
        segments=segments,
        freeze=tuning.freeze,
        lora=tuning.lora,
        vocab_pieces=tuning.vocab_pieces or 1,
    )


def vocab_size(family: Any, preset: str) -> int | None:
    """The preset's vocabulary (None when its config names none)."""
    return getattr(family.config(preset), "vocab_size", None)


def position_overrides(family: Any, preset: str, seq_len: int) -> dict[str, int]:
    """Lengthen the preset's position table to ``seq_len`` where it is shorter."""
    config = family.config(preset)
    for field in MAX_SEQ_LEN_FIELDS:
        longest = getattr(config, field, None)
        if isinstance(longest, int) and seq_len > longest:
            return {field: seq_len}
    return {}


def cell_overrides(family: Any, cell: Cell) -> dict[str, int]:
    """The preset's fields a cell changes: the position table (``position_overrides``)
    and the vocabulary, where the cell's is not the preset's."""
    overrides = position_overrides(family, cell.preset, cell.seq_len)
    if cell.vocab_size is not None and cell.vocab_size != vocab_size(family, cell.preset):
        overrides["vocab_size"] = cell.vocab_size
    return overrides


def step_flops(step: Lowered) -> tuple[float, float]:
    """``(model, executed)`` FLOPs of a lowered step from its family's declared work: the
    model's are forward, head and backward of every round; executed adds recompute."""
    program, layout, family, config = step.program, step.layout, step.family, step.config
    train = layout.train
    act_bytes = DTYPE_BYTES[train.dtype.activation]
    kinds = {layer.name: layer.kind for layer in layout.layers}
    costs: dict[str, Any] = {}
    model = executed = 0.0
    for task in program.tasks:
        slot = layout.tasks[task.id]
        kind = kinds.get(slot.layer)
        if task.kind not in ("embed", "fwd", "head", "rec", "bwd", "embbwd"):
            continue  # optimizer and norm tasks: no matrix work worth counting
        if kind not in costs:
            costs[kind] = family.math(kind).cost(config, train.batch, train.seq_len, act_bytes)
        cost = costs[kind]
        if task.kind == "rec":
            partial = task.params.get("partial")
            work = cost.partial[partial] if partial else (cost.recompute or cost.forward)
            executed += work.flops
            continue
        work = cost.backward if task.kind in ("bwd", "embbwd") else cost.forward
        model += work.flops
        executed += work.flops
    return model, executed


def recomputed(step: Lowered) -> list[str]:
    """The recomputed units as ``round:block`` (block = the layer's name), and
    ``round:block:partial`` for a unit saved partially (its rest re-derived)."""
    program, layout = step.program, step.layout
    return [
        ":".join((str(slot.round_), slot.layer, *filter(None, [task.params.get("partial")])))
        for task in program.tasks
        if (slot := layout.tasks[task.id]).kind == "rec"
    ]


def row_of(planned: Any, step: Lowered, cell: Cell, extra: dict[str, Any]) -> dict[str, Any]:
    """A feasible cell's row from its plan (``dataflow.planning.Plan``) and its step
    (``planned.program`` with its layout)."""
    sim, program = planned.sim, planned.program
    step_us = planned.cycle.iteration_us if planned.cycle is not None else sim.makespan_us
    step_s = step_us / 1e6
    model, executed = step_flops(step)
    rec_us = sum(t.cost_us for t in program.tasks if t.kind == "rec")
    units = recomputed(step)
    blocks = sorted({u.split(":")[1] for u in units}, key=_natural)
    return {
        **cell.key(),
        **extra,
        "feasible": True,
        "reason": None,
        "step_s": step_s,
        "tok_s": cell.tokens_step / step_s,
        "effective_tflops": model / step_us / 1e6,
        "hardware_tflops": executed / step_us / 1e6,
        "fast_peak_bytes": sim.fast_peak_bytes,
        "backing_peak_bytes": sim.slow_peak_bytes,
        "h2d_gb": sim.h2d.bytes / 1e9,
        "d2h_gb": sim.d2h.bytes / 1e9,
        "h2d_link_pct": 100 * sim.h2d.busy_us / step_us,
        "d2h_link_pct": 100 * sim.d2h.busy_us / step_us,
        "recompute_pct": 100 * rec_us / step_us,
        "compute_idle_pct": 100 * sim.compute_idle_us / sim.makespan_us,
        "recomputed_units": len(units),
        "recomputed_layers": blocks,
        "partial_units": sum(1 for u in units if u.count(":") == 2),
        "lower_bound_s": planned.lower_bound_us / 1e6,
    }


def _natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def infeasible_row(cell: Cell, extra: dict[str, Any], reason: str) -> dict[str, Any]:
    return {**cell.key(), **extra, "feasible": False, "reason": reason}


@attrs.frozen
class PlannedCell:
    """A cell lowered, priced and planned: ``planned`` (a ``dataflow.planning.Plan``), or
    ``reason`` why it cannot run; ``extra`` the row's fields that say how.
    ``workspace_beside_bytes``: with measured costs, the task workspace the plan leaves
    beside its arena (its tasks hold none; ``place(..., workspace_beside_bytes=...)``).
    ``lowered`` is the step as lowered and priced, ``rewriter`` the recompute search's
    (None without one): ``step_of`` gives the step of the plan, or of a placement's."""

    cell: Cell
    extra: dict[str, Any]
    planned: Any = None
    reason: str | None = None
    workspace_beside_bytes: int = 0
    lowered: Any = None
    rewriter: Any = None

    def step_of(self, program: Program | None = None) -> Lowered:
        """The step whose program is ``program`` (default: the plan's)."""

        chosen = self.planned.program if program is None else program
        return running_step(self.lowered, self.rewriter, chosen)


def plan_cell(
    family: Any,
    cell: Cell,
    hw: HardwareEntry,
    *,
    recompute: bool = True,
    dtype: str = "bf16",
    states: str = "fp32",
    precision: str | None = None,
    segments: bool = False,
    tuning: Tuning | None = None,
    train: TrainConfig | None = None,
    measure: Callable[[Lowered], dict] | None = None,
    reserve_bytes: int = 0,
    ranks: int | None = None,
    scope: str = "nvlink",
    cyclic: bool | None = None,
) -> PlannedCell:
    """Lower, price and plan one cell (module docstring); ``train`` replaces the cell's
    default training step (``train_config``) with one of the same shape. ``ranks``: the
    step of one member of a fleet of that many (equal shares), its all-reduce priced on
    the ``scope`` collective link. ``cyclic`` (default: when the program has persistent
    objects, as a run's does) plans the steady-state cycle; False plans one run of the
    step from slow memory to slow memory."""
    # torch loads when a profile is taken: `dataflow predict` reads this module without it
    from dataflow_training.plan.profile import apply_profile, without_workspace

    extra: dict[str, Any] = {"hw": hw.name, "costs": "measured" if measure else "roofline"}
    extra["optimizer_states"] = states
    extra["precision"] = precision or pinned(dtype, states).name
    if tuning is not None:
        extra |= tuning.fields()
    if ranks is not None:
        extra |= {"ranks": ranks, "scope": scope}
    reason = cell.why_not()
    if reason is not None:
        return PlannedCell(cell, extra, reason=reason)
    overrides = cell_overrides(family, cell) | (tuning.overrides() if tuning else {})
    extra["overrides"] = overrides
    started = time.perf_counter()
    vocab = cell.vocab_size or vocab_size(family, cell.preset)
    train = train or train_config(
        cell,
        dtype,
        vocab=vocab,
        states=states,
        precision=precision,
        segments=segments,
        tuning=tuning,
    )
    lowered = lower(
        family,
        cell.preset,
        train,
        overrides=overrides,
        cost=hw.roofline(train.dtype.param),
        links=hw.links(ranks, scope),
        grad_share=None if ranks is None else 1.0 / ranks,
    )
    rewriter = Rewriter(lowered) if recompute and measure is None else None
    beside = 0  # measured workspace is the allocator's, beside the arena (as on CUDA)
    if measure is not None:
        largest = [0]

        def measured(candidate: Lowered) -> dict:
            found, most = without_workspace(measure(candidate))
            largest[0] = max(largest[0], most)
            return found

        profiles = measured(lowered)
        lowered = lowered.with_program(apply_profile(lowered, profiles))
        if recompute:
            rewriter = measured_rewriter(lowered, measured, known=profiles)
        beside = largest[0]
    program = lowered.program
    planner = step_planner(rewriter, MAX_CANDIDATES) if rewriter is not None else PRESSUREFIT
    budget = cell.budget_bytes - reserve_bytes - beside
    if budget < 1:
        reason = (
            f"the device's libraries ({reserve_bytes} bytes) and the largest task "
            f"workspace ({beside} bytes) take all of it"
        )
        return PlannedCell(cell, extra, reason=reason)
    try:
        planned = plan(
            program,
            budget,
            planner=planner,
            slow_budget_bytes=cell.backing_bytes,
            cyclic=bool(program.persistent) if cyclic is None else cyclic,
        )
    except PlanningError as exc:
        reason = _one_line(str(exc))
        if beside:
            reason += (
                f" (planned at the budget less {reserve_bytes} bytes for the device's "
                f"libraries and {beside} bytes of task workspace beside the arena)"
            )
        return PlannedCell(cell, extra, reason=reason)
    extra["planning_s"] = time.perf_counter() - started
    return PlannedCell(cell, extra, planned, None, beside, lowered, rewriter)


def predict_cell(family: Any, cell: Cell, hw: HardwareEntry, **options: Any) -> dict[str, Any]:
    """The row of one cell (module docstring; ``plan_cell``'s options). ``measure`` (a
    program -> profiles function, e.g. the profiling pass through its cache) prices the
    step instead of the roofline; ``reserve_bytes`` is left out of the budget for the
    device's libraries; ``ranks`` adds the fleet member's all-reduce
    (``fleet_fields``)."""
    planned = plan_cell(family, cell, hw, **options)
    if planned.reason is not None:
        return infeasible_row(cell, planned.extra, planned.reason)
    row = row_of(planned.planned, planned.step_of(), cell, planned.extra)
    ranks = options.get("ranks")
    if ranks is not None:
        row |= fleet_fields(planned.planned, ranks, planned.planned.program.links.collective)
    return row


def fleet_fields(planned: Any, ranks: int, link: Any) -> dict[str, Any]:
    """A fleet member's all-reduce from its plan's simulated step: the collective link's
    busy time, the part of it during which compute was idle (exposed: the step waited
    for it) and the rest (hidden under the backward), and the fleet's tokens/s."""
    sim = planned.sim
    exposed_us = sim.collective_exposed_us
    return {
        "collective_bw_gbps": link.bw_bytes_per_us / 1e3,
        "collective_latency_us": link.latency_us,
        "allreduce_groups": sim.collective.transfers,
        "allreduce_gb": sim.collective.bytes / 1e9,
        "allreduce_s": sim.collective.busy_us / 1e6,
        "allreduce_exposed_s": exposed_us / 1e6,
        "allreduce_hidden_s": (sim.collective.busy_us - exposed_us) / 1e6,
    }


def predict_fleet(
    family: Any,
    cells: Iterable[Cell],
    hw: HardwareEntry,
    ranks: Sequence[int],
    *,
    scope: str = "nvlink",
    progress: Callable[[dict[str, Any]], None] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """For every cell, one row per fleet size in ``ranks`` (``predict_cell`` with
    ``ranks``), each with ``fleet_tok_s`` (ranks x the member's tokens/s) and
    ``scaling_efficiency`` against the cell's plain step (predicted once per cell; its
    ``single_step_s`` is in the row)."""
    rows = []
    for cell in cells:
        single = predict_cell(family, cell, hw, **options)
        for n in ranks:
            row = predict_cell(family, cell, hw, ranks=n, scope=scope, **options)
            if row["feasible"]:
                row["fleet_tok_s"] = n * row["tok_s"]
                row["single_step_s"] = single["step_s"] if single["feasible"] else None
                row["scaling_efficiency"] = (
                    single["step_s"] / row["step_s"] if single["feasible"] else None
                )
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _one_line(text: str) -> str:
    return " ".join(text.split())


def predict(
    family: Any,
    cells: Iterable[Cell],
    hw: HardwareEntry,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    jobs: int = 1,
    **options: Any,
) -> list[dict[str, Any]]:
    """Every cell's row (``predict_cell``), ``progress(row)`` after each, in the cells'
    order. ``jobs`` > 1 plans that many cells at once, each in a forked worker process
    (cells are independent; planning is pure Python, so threads would not help). Where
    the platform cannot fork, or a cell is priced by ``measure`` (the profiling pass may
    hold a CUDA context, which a fork cannot carry), cells are planned one by one."""
    cells = list(cells)
    forkable = "fork" in multiprocessing.get_all_start_methods()
    if jobs <= 1 or len(cells) <= 1 or not forkable or options.get("measure") is not None:
        return each_cell(predict_cell, family, cells, hw, progress, **options)
    global _FORKED
    _FORKED = (family, cells, hw, options)
    rows = []
    try:
        context = multiprocessing.get_context("fork")
        with context.Pool(min(jobs, len(cells)), initializer=_worker_start) as pool:
            for row in pool.imap(_forked_row, range(len(cells))):
                rows.append(row)
                if progress is not None:
                    progress(row)
    finally:
        _FORKED = None
    return rows


#: what ``predict``'s forked workers plan: (family, cells, hw, options), set before the
#: fork (a family is a module, which does not pickle; a worker inherits it)
_FORKED: tuple[Any, list[Cell], HardwareEntry, dict[str, Any]] | None = None


def _worker_start() -> None:
    # torch loads when a profile is taken: `dataflow predict` reads this module without it
    import torch

    torch.set_num_threads(1)  # one core a worker: the pool already fills the machine


def _forked_row(index: int) -> dict[str, Any]:
    assert _FORKED is not None, "predict's workers are forked with the cells to plan"
    family, cells, hw, options = _FORKED
    return predict_cell(family, cells[index], hw, **options)


def default_jobs() -> int:
    """The CPUs this process may run on (a container's or taskset's limit, not the
    host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def each_cell(
    row_of_cell: Callable[..., dict[str, Any]],
    family: Any,
    cells: Iterable[Cell],
    hw: HardwareEntry,
    progress: Callable[[dict[str, Any]], None] | None,
    **options: Any,
) -> list[dict[str, Any]]:
    """``row_of_cell(family, cell, hw, **options)`` for every cell, ``progress(row)``
    after each (``predict`` and ``measure``)."""
    rows = []
    for cell in cells:
        rows.append(row_of_cell(family, cell, hw, **options))
        if progress is not None:
            progress(rows[-1])
    return rows
