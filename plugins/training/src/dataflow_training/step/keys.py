"""Compute keys of lowered training steps: built and parsed here, nowhere else.

A family task's key is ``<family>.<layer kind>.<phase>`` (``gpt2.block.backward``,
``gpt2.head.loss``); an optimizer task's is ``optim.<optimizer>`` (``optim.adamw``); a gradient-norm task's is ``grad.norm``; a fleet's gradient all-reduce task's is
``grad.allreduce``.
Phases: ``embed`` layers have ``forward`` and ``backward``; block kinds have ``forward``,
``recompute`` and ``backward``; the ``head`` has the fused ``loss``.
"""

from __future__ import annotations

import attrs

EMBED_PHASES = ("forward", "backward")
BLOCK_PHASES = ("forward", "recompute", "backward")
#: a block kind that routes its experts apart (``BlockMath.experts_apart``): the routing
#: forward, recompute and backward of the block (all but the routed experts) and one
#: expert shard's forward and backward
ROUTED_PHASES = (
    "route_forward",
    "route_recompute",
    "route_backward",
    "experts_forward",
    "experts_backward",
)
HEAD_PHASES = ("loss",)
OPTIMIZER_PREFIX = "optim"
#: the key of a ``gnorm`` task (a parameter group's squared gradient norm, for clipping)
GRAD_NORM_KEY = "grad.norm"
#: the key of an ``allreduce`` task (a fleet member's share of a parameter group's gradient,
#: summed over the data-parallel group by ``torch.distributed``)
GRAD_ALLREDUCE_KEY = "grad.allreduce"


class ComputeKeyError(KeyError):
    """A compute key that no training task has; the message says what would be valid."""

    def __str__(self) -> str:  # KeyError quotes its argument; this is a sentence
        return str(self.args[0])


@attrs.frozen
class ComputeKey:
    """``family`` is ``None`` for an optimizer key, whose ``kind`` is the optimizer name
    (phase ``update``), and for the gradient-norm key (kind ``grad``, phase ``norm``)."""

    family: str | None
    kind: str
    phase: str

    def __str__(self) -> str:
        if self.is_grad_norm:
            return GRAD_NORM_KEY
        if self.is_grad_allreduce:
            return GRAD_ALLREDUCE_KEY
        if self.family is None:
            return f"{OPTIMIZER_PREFIX}.{self.kind}"
        return f"{self.family}.{self.kind}.{self.phase}"

    @property
    def is_optimizer(self) -> bool:
        return self.family is None and self.phase == "update"

    @property
    def is_grad_norm(self) -> bool:
        return self.family is None and (self.kind, self.phase) == ("grad", "norm")

    @property
    def is_grad_allreduce(self) -> bool:
        return self.family is None and (self.kind, self.phase) == ("grad", "allreduce")


def family_key(family: str, kind: str, phase: str) -> str:
    return str(ComputeKey(family, kind, phase))


def optimizer_key(name: str) -> str:
    return str(ComputeKey(None, name, "update"))


def parse(key: str) -> ComputeKey:
    """The parts of ``key``; a malformed key raises ``ComputeKeyError`` naming it."""
    if key == GRAD_NORM_KEY:
        return ComputeKey(None, "grad", "norm")
    if key == GRAD_ALLREDUCE_KEY:
        return ComputeKey(None, "grad", "allreduce")
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == OPTIMIZER_PREFIX and parts[1]:
        return ComputeKey(None, parts[1], "update")
    if len(parts) == 3 and all(parts):
        family, kind, phase = parts
        allowed = {"embed": EMBED_PHASES, "head": HEAD_PHASES}.get(
            kind, BLOCK_PHASES + ROUTED_PHASES
        )
        if phase in allowed:
            return ComputeKey(family, kind, phase)
    raise ComputeKeyError(
        f"compute key {key!r} is not a training key; expected <family>.embed.forward|backward, "
        "<family>.head.loss, <family>.<block kind>.forward|recompute|backward (or, routed "
        "apart, route_forward|route_recompute|route_backward|experts_forward|"
        "experts_backward), "
        f"optim.<optimizer>, {GRAD_NORM_KEY} or {GRAD_ALLREDUCE_KEY}"
    )
