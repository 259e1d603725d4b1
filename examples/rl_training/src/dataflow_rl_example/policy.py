"""The policy trainer: lower, plan and run one update per batch of rollouts.

``PolicyTrainer(family, config, state)`` holds the model state and the AdamW moments.
``update(rollouts, lr=...)`` lowers the update for the rollouts' shape (once per shape;
its rows in ``options.rounds`` micro-batches), plans it into the fast-memory budget with
PressureFit, places it in one arena (leaving room beside it for the tasks' temporaries:
``workspace_estimate``, or ``workspace_bytes``), loads it into the engine and runs it;
later updates of the same shape feed the next rollouts to the same engine. ``state()``
reads the weights back (keyed as the family's reference model), and ``export(path)``
writes them as an HF checkpoint folder an inference engine loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dataflow_training import load_family

from dataflow import Engine, InfeasibleBudget, format_size, place, plan, runtime_reserve_bytes
from dataflow_rl_example import tasks
from dataflow_rl_example.program import STATS, WHOLE, UpdateOptions, UpdateStep, lower_update
from dataflow_rl_example.rollouts import Rollouts


class BudgetError(ValueError):
    """A fast-memory budget no plan of the update fits (names the smallest that does)."""


#: bytes a large tensor's block may exceed its size by: torch's caching allocator hands out
#: a whole cached block (over 1 MiB) unless more than 1 MiB would be left over, and
#: ``memory_allocated`` counts the whole block
LARGE_BLOCK_SLACK = 1 << 20
#: the head's large temporaries at its peak: the chunk's float32 logits and log-probs, the
#: hidden states' float32 gradient, the normed hidden states (measured on the H100, session
#: 32: the head took 1.6 MB past the other terms with llama3_tiny at a 32,000 vocabulary
#: and 3.4 MB with l3_1b, both under four blocks' slack)
HEAD_LARGE_TEMPORARIES = 4


def workspace_estimate(step: UpdateStep, device: str = "cpu") -> int:
    """The task temporaries to leave beside the planned arena, for one round's rows: the
    head's (a chunk's logits in float32 and their log-probs, 8 bytes an entry at the peak,
    as later the log-probs and the gradient's two bfloat16 casts; its hidden states, their
    gradient in float32 and the chunk's rows of them; on CUDA the allocator's rounding of
    its large blocks) or a block's (taken as twice its saved context plus four hidden states),
    whichever is more (AdamW's are a slice's: ``tasks.ADAMW_SLICE``). On CUDA the trainer
    also leaves ``runtime_reserve_bytes`` (the libraries' and the engine's own). An
    estimate: the engine checks the allocator's peak against the budget and a breach names
    it; ``tasks.task_temporaries`` measures each task's (then pass ``workspace_bytes``)."""
    sizes = {obj.id: obj.size_bytes for obj in step.program.objects}
    first, last = step.each("h_0", 0), step.each(f"h_{len(step.blocks)}", 0)
    hidden = sizes[first] if first in sizes else sizes[last]
    tokens = step.round_rows * (step.length - 1)
    chunk = min(step.options.chunk_tokens, tokens)
    # and the chunk's own rows of the hidden states (gathered by index: a copy), and the
    # CUDA allocator's rounding of the large temporaries alive at once
    head = chunk * step.config.vocab_size * 8 + 3 * hidden + -(-hidden * chunk // tokens)
    if torch.device(device).type == "cuda":
        head += HEAD_LARGE_TEMPORARIES * LARGE_BLOCK_SLACK
    saved = (2 * sizes[step.each(f"A_{i}", 0)] for i in range(len(step.blocks)))
    block = max(saved, default=0) + 4 * hidden
    return max(head, block)


def _device_bytes(device: str) -> int | None:
    """A CUDA device's whole memory (None elsewhere: the engine checks no allocator)."""
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None


class PolicyTrainer:
    """Policy updates of one model, from rollouts an inference engine wrote.

    ``budget_bytes``: the fast-memory budget the update is planned into, task workspace
    beside the arena included; on CUDA the engine holds the device allocator's peak to
    it. None: every object kept (a budget of their sum and the workspace), the allocator
    held to the device's memory.

    ``compiled``: how the blocks' recompute and backward run (``tasks.strategy``): by
    default compiled with inductor on CUDA (the first update compiles each block kind's
    math once for all blocks) and eagerly elsewhere; None runs them eagerly everywhere.
    ``graph``: on CUDA the engine captures the update into a CUDA graph at the second update
    and replays it from the third (``Engine(graph=True)``; its per-step values as device
    tensors), the head then scoring every position (``tasks.Head``). Not yet measured on the
    device: off by default until it is (``engine.graph_note`` says why a step was not
    captured)."""

    def __init__(
        self,
        family: str | Any,
        config: Any,
        state: Mapping[str, torch.Tensor],
        options: UpdateOptions | None = None,
        *,
        budget_bytes: int | None = None,
        device: str = "cpu",
        optimizer_state: Mapping[str, torch.Tensor] | None = None,
        workspace_bytes: int | None = None,
        compiled: str | None = "auto",
        graph: bool = False,
    ) -> None:
        self.family = load_family(family) if isinstance(family, str) else family
        self.config, self.options = config, options or UpdateOptions()
        self.budget_bytes, self.device = budget_bytes, device
        self.workspace_bytes = workspace_bytes
        self.compiled = compiled  # how the blocks' math runs: tasks.strategy's argument
        self.graph = graph
        self.updates = 0  # AdamW's step count so far
        self._state = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
        # the AdamW moments by object id (O_<layer>...), packed; none: zero
        self._moments: dict[str, torch.Tensor] = {}
        if optimizer_state is not None:
            self.updates = int(optimizer_state["updates"])
            self._moments = {k: v for k, v in optimizer_state.items() if k != "updates"}
        self._engine: Engine | None = None
        self._step: UpdateStep | None = None
        self.last_plan: Any = None
        #: the engine's ``RunResult`` of the last update (its tasks' measured spans)
        self.last_run: Any = None

    # -- the update ----------------------------------------------------------------------
    def update(self, rollouts: Rollouts, *, lr: float, kl_coef: float = 0.0) -> dict[str, float]:
        """One policy update from ``rollouts``; returns its stats (``loss``, mean
        ``ratio``, the fraction of ``clipped`` ratios, mean ``kl``)."""
        rollouts.check()
        if self.options.kl and rollouts.ref_logprobs is None:
            raise ValueError("the update has the KL term, but the rollouts carry no ref_logprobs")
        shape = (rollouts.rows, rollouts.length, rollouts.hidden_layers)
        step = self._step
        if step is None or (step.rows, step.length, step.hidden_layers) != shape:
            self._load(rollouts)  # the engine starts with these rollouts
            feed = None
        else:
            feed = lambda _: self._batch(rollouts)  # noqa: E731 - the next step's batch
        self.last_run = self._engine.run(values=self._values(lr, kl_coef), feed=feed)
        self.updates += 1
        return self._stats()

    def _values(self, lr: float, kl_coef: float) -> dict[str, Any]:
        values = {"lr": float(lr), "adam_step": self.updates + 1}
        return values | ({"kl_coef": float(kl_coef)} if self.options.kl else {})

    def lowered(self, rollouts: Rollouts) -> UpdateStep:
        """The update this trainer lowers for the rollouts' shape (rows, length, the layers
        whose inputs they hand over)."""
        return lower_update(
            self.family,
            self.config,
            rows=rollouts.rows,
            length=rollouts.length,
            hidden_layers=rollouts.hidden_layers,
            options=self.options,
        )

    def _load(self, rollouts: Rollouts) -> None:
        """Lower and plan for the rollouts' shape; start an engine with the current state."""
        if self._engine is not None:
            self._sync()
            self._engine.close()
        step = self.lowered(rollouts)
        beside = self.workspace_bytes or workspace_estimate(step, self.device)
        if torch.device(self.device).type == "cuda":
            # and what the CUDA libraries and the engine keep beside the arena (the cuBLAS
            # workspace of each stream, the values buffer): l3_1b's 4 GiB update on the
            # H100 went 16 MB over its budget without it, its head 3.4 MB of that
            beside += runtime_reserve_bytes(self.device)
        budget = self.budget_bytes or sum(obj.size_bytes for obj in step.program.objects) + beside
        # the tasks' temporaries come from the device allocator, beside the planned arena
        try:
            self.last_plan = plan(step.program, max(budget - beside, 1))
        except InfeasibleBudget as error:
            raise BudgetError(
                f"budget {format_size(budget)}: the update needs at least "
                f"{format_size(error.minimal_budget_bytes + beside)} (a plan of "
                f"{format_size(error.minimal_budget_bytes)} and {format_size(beside)} of task "
                "workspace beside it)"
            ) from None
        placement = place(self.last_plan, workspace_in_arena=False, workspace_beside_bytes=beside)
        # no budget given, none is claimed: every object is kept and the engine holds the
        # allocator to the device's whole memory (a budget's check would count what runs
        # once at the first update beside it, e.g. inductor compiling the blocks)
        held = budget if self.budget_bytes else _device_bytes(self.device)
        engine = Engine("torch", budget_bytes=held, device=self.device, graph=self.graph)
        initial = self._weights(step) | self._batch(rollouts, step)
        resolver = tasks.build(step, self.device, self.compiled, graph=self.graph)
        engine.load(placement, resolver, initial=initial)
        self._engine, self._step = engine, step

    def _weights(self, step: UpdateStep) -> dict[str, torch.Tensor]:
        """The parameter and moment objects of ``step``, packed from the state."""
        found = {}
        for layer in step.layers:
            for oid, group in step.param_objects(layer).items():
                found[oid] = step.packings[oid].pack(
                    {
                        p.name: _stored(self._state[f"{layer.name}.{p.name}"], p)
                        for p in group.params
                    }
                )
                moments = "O" + oid[1:]
                found[moments] = self._moments.get(moments)
                if found[moments] is None:
                    found[moments] = torch.zeros(
                        step.packings[moments].size_bytes, dtype=torch.uint8
                    )
        return found

    def _batch(self, rollouts: Rollouts, step: UpdateStep | None = None) -> dict[str, torch.Tensor]:
        """The rollout's objects: the model reads tokens 0..T-2 and scores tokens 1..T-1."""
        step = step or self._step
        batch = {
            "tokens": rollouts.tokens[:, :-1],
            "targets": rollouts.tokens[:, 1:],
            "scored": rollouts.completion_mask[:, 1:].float(),
            "behaviour": rollouts.behaviour_logprobs[:, 1:].float(),
            "rewards": rollouts.rewards.float(),
            "groups": rollouts.groups.long(),
        }
        if self.options.kl:
            batch["ref"] = rollouts.ref_logprobs[:, 1:].float()
        dtype = getattr(torch, self.options.dtype)
        batch |= {f"h_{layer}": hidden.to(dtype) for layer, hidden in rollouts.hidden.items()}
        rounds = {}  # each round's slice of what scales with the rows
        for name, t in batch.items():
            rounds |= {name: t} if name in WHOLE else step.split(name, t)
        return {name: t.contiguous() for name, t in rounds.items() if name in _ids(step)}

    def _stats(self) -> dict[str, float]:
        values = self._engine.fetch("stats").tolist()
        return dict(zip(STATS, values, strict=True))

    # -- the state -------------------------------------------------------------------------
    def _sync(self) -> None:
        """Read the engine's weights and moments back into the trainer's state."""
        step, engine = self._step, self._engine
        if step is None or engine is None:
            return
        for layer in step.layers:
            for oid, group in step.param_objects(layer).items():
                views = step.packings[oid].views(engine.fetch(oid))
                for p in group.params:
                    view = views[p.name][: p.rows]
                    self._state[f"{layer.name}.{p.name}"] = view.to(torch.float32, copy=True)
                self._moments["O" + oid[1:]] = engine.fetch("O" + oid[1:])

    def state(self) -> dict[str, torch.Tensor]:
        """The model's weights now, keyed as the family's reference model."""
        self._sync()
        return dict(self._state)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The AdamW moments and step count (``optimizer_state=`` of a later trainer)."""
        self._sync()
        return {**self._moments, "updates": torch.tensor(self.updates)}

    def export(self, path: str | Path) -> Path:
        """Write the weights as an HF checkpoint folder (safetensors + config.json)."""
        self.family.export_hf(self.config, self.state(), path)
        return Path(path)

    @property
    def graph_note(self) -> str | None:
        """Why the updates are dispatched rather than replayed from a CUDA graph (None while
        they are replayed, or may be; ``graph=True`` only)."""
        return None if self._engine is None else self._engine.graph_note

    @property
    def replaying(self) -> bool:
        """Whether the last update was replayed from a captured CUDA graph (``graph=True``,
        from the second update on)."""
        return self.last_run is not None and self.last_run.steps[-1].replayed

    def close(self) -> None:
        if self._engine is not None:
            self._sync()
            self._engine.close()
            self._engine = None
            self._step = None


def _stored(tensor: torch.Tensor, spec: Any) -> torch.Tensor:
    """A state tensor in the shape the step stores (a vocabulary table padded with zero rows)."""
    if tuple(tensor.shape) == tuple(spec.shape):
        return tensor
    padded = tensor.new_zeros(spec.shape)
    padded[: tensor.shape[0]] = tensor
    return padded


def _ids(step: UpdateStep) -> set[str]:
    return {obj.id for obj in step.program.objects}
