"""``TrainOptions``: everything ``dataflow train`` takes, as one value, and what follows
from it alone: its precision policy, its step (``TrainConfig``), the compiled step
(``compile_step``) and its feed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dataflow import feeds
from dataflow_training.drive.phases import Phase, phases_of
from dataflow_training.drive.profiling import ProfileWindow
from dataflow_training.drive.run import resolver_for
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.step.config import TrainConfig, head_chunk_tokens
from dataflow_training.step.lora import LoraConfig
from dataflow_training.step.precision import Precision, for_optimizer


@attrs.frozen
class TrainOptions:
    """Everything ``dataflow train`` takes (see its ``--help``)."""

    family: str
    preset: str
    steps: int
    out: Path = attrs.field(converter=Path)
    data: str = "embedded:python-stdlib"
    batch: int = 8
    rounds: int = 1
    seq_len: int = 64
    budget_bytes: int | None = None
    #: the backing (pinned host) budget of the step's plan; None: unbounded
    backing_bytes: int | None = None
    device: str = "cpu"
    checkpoint_every: int | None = None
    #: a checkpoint after the first step that ends this many minutes after the last one
    #: (None: off), so that a run without ``checkpoint_every`` keeps its work too
    checkpoint_minutes: float | None = 30.0
    resume: str | None = None
    #: a new run into a folder that holds another run moves that run aside (else refused)
    overwrite: bool = False
    keep: int | None = None
    lr: float = 3e-4
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    #: a resumed run starts a new lr schedule (``schedule.resumed``) at its checkpoint's
    #: step, of ``lr``, ``warmup``, ``schedule`` and ``min_lr_ratio``; without it the run's
    #: schedule goes on and a change of those is refused
    reset_schedule: bool = False
    clip: float | None = 1.0
    seed: int = 0
    #: the precision policy (``step.precision``: auto, bf16, bf16-plain, mixed, fp32);
    #: ``train`` records the one ``auto`` chose, so a resume on another device keeps it
    precision: str = "auto"
    #: expert pins of the weights' and the AdamW moments' dtypes (fp32 or bf16; None: the
    #: policy's); alone they name a plain update (``precision.pinned``)
    dtype: str | None = None
    optimizer_states: str | None = None
    #: the registered optimizer (``--optimizer``) and its typed arguments (``--optimizer-arg``)
    optimizer: str = "adamw"
    optimizer_args: dict[str, Any] = attrs.field(factory=dict)
    overrides: dict[str, Any] = attrs.field(factory=dict)
    profile: ProfileWindow | None = None
    graph: bool = True
    recompute: bool = True
    trace_steps: int = 0
    order: str = "round"  # TrainConfig.order
    updates: str = "auto"  # TrainConfig.updates
    head_vocab_tiles: bool = False  # TrainConfig.head_vocab_tiles
    head_accumulate: str = "float32"  # TrainConfig.head_accumulate
    vocab_pieces: int = 1  # TrainConfig.vocab_pieces
    block_row_groups: int = 1  # TrainConfig.block_row_groups
    #: the registered resolver that runs the tasks, or "auto" (``run.resolver_for``)
    resolver: str = "auto"
    #: a Hugging Face model folder whose weights start the run (``hf_init``); its config's
    #: fields that differ from the preset's become the run's overrides
    init: str | None = None
    #: the model's vocabulary as given (``--vocab-size``); None: the data's tokenizer's or
    #: the preset's (``vocabulary.choose_vocab``), which the run's overrides then carry
    vocab_size: int | None = None
    #: the optimizer's batch in tokens (``--tokens-per-step``); the search's choice
    tokens_per_step: int | None = None
    #: the fields the step search chooses before the run starts (``step_search.SEARCHED``;
    #: their values here are placeholders); empty: every field is as given
    search: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the host memory the step may hold (None: the machine's available memory)
    host_bytes: int | None = None
    #: the slow budget the step search planned the chosen shape in, where the host's
    #: memory called for one (``Tried.slow_budget_bytes``): ``compile_step`` plans there
    #: first, so it finds the search's plan (``first_slow_bytes``)
    search_slow_bytes: int | None = None
    #: validation (``drive.evaluation``): every ``eval_every`` steps (None: off), the loss
    #: of ``eval_tokens`` held-out tokens: the ``val`` shards of a ``shards:`` ``data``, or
    #: the feed ``val_data`` names
    eval_every: int | None = None
    eval_tokens: int = 8192
    val_data: str | None = None
    #: the parameters that do not train (``TrainConfig.freeze``, ``step.freezing``), from
    #: step 0 to the first of ``phases``
    freeze: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the later phases of the run, each from its step on (``drive.phases``)
    phases: tuple[Phase, ...] = attrs.field(default=(), converter=phases_of)
    #: LoRA's rank (``--lora``; None: no adapters, everything not frozen trains) and its
    #: alpha (None: 2 x rank), dropout, targets (empty: the default) and base storage
    #: (None: the parameter dtype), ``step.lora``
    lora: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    lora_base: str | None = None
    #: rows hold several documents, each apart (``--pack-documents``: the step lowered
    #: with ``TrainConfig.segments``, the feed read with ``next_documents``)
    pack_documents: bool = False

    @property
    def policy(self) -> Precision:
        """The precision policy of ``precision`` and the pins on ``device``."""
        return for_optimizer(
            self.precision,
            self.optimizer,
            device=self.device,
            dtype=self.dtype,
            states=self.optimizer_states,
        )

    def train_config(self, family: Any) -> TrainConfig:
        """The step of ``family`` (the family object ``self.family`` names); the head's
        token chunk follows the budget as ``predict``'s does (``head_chunk_tokens``), 1024
        tokens without one."""
        chunk = 1024
        if self.budget_bytes is not None:
            vocab = getattr(family.config(self.preset, **self.overrides), "vocab_size", None)
            if vocab:
                chunk = head_chunk_tokens(self.budget_bytes, vocab)
        policy = self.policy
        return TrainConfig(
            seq_len=self.seq_len,
            batch=self.batch,
            rounds=self.rounds,
            dtype=policy.dtype,
            optimizer=policy.optimizer_policy(self.optimizer, self.optimizer_args, lr=self.lr),
            chunk_tokens=chunk,
            clip=self.clip,
            grad_norm=True,
            order=self.order,
            updates=self.updates,
            head_vocab_tiles=self.head_vocab_tiles,
            head_accumulate=self.head_accumulate,
            vocab_pieces=self.vocab_pieces,
            block_row_groups=self.block_row_groups,
            freeze=self.freeze,
            lora=self.lora_config,
            segments=self.pack_documents,
        )

    @property
    def lora_config(self) -> LoraConfig | None:
        """The run's ``LoraConfig``, or None without ``--lora``."""
        if self.lora is None:
            return None
        return LoraConfig(
            self.lora, self.lora_alpha, self.lora_dropout, self.lora_targets, self.lora_base
        )

    def compile(self, family: Any, **more: Any) -> Any:
        """``compile_step`` of the step of ``family`` (the family object ``self.family``
        names) in this run's budgets, on its device with its resolver; ``more``: the
        other ``compile_step`` options (the fleet's, ``forward_only``)."""
        return compile_step(
            family,
            self.preset,
            self.train_config(family),
            overrides=self.overrides,
            budget_bytes=self.budget_bytes,
            backing_bytes=self.backing_bytes,
            first_slow_bytes=self.search_slow_bytes,
            device=self.device,
            graph=self.graph,
            resolver=resolver_for(self.resolver, self.device),
            **more,
        )


def open_feed(o: TrainOptions) -> Any:
    """``o``'s feed: the one-process stream (a fleet's members deal its rounds); before
    the step search chose the shape, one of the shape given (for its vocabulary)."""

    return feeds().open(o.data, **feed_shape(o), seed=o.seed, rank=0, world=1)


def feed_shape(o: TrainOptions) -> dict[str, int]:
    """The batch and sequence length a feed of ``o`` is opened with: before the step
    search, those given (1 where not)."""
    return {"batch": o.batch or 1, "seq_len": o.seq_len or 1}
