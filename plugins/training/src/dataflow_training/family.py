"""What a model family provides to the training plugin.

A family plugin registers ``FamilySpec(name, description, load)`` through the
``dataflow_families`` hook; ``load()`` returns an object satisfying ``Family`` below.
Everything a family computes is plain torch on plain tensors: no dataflow objects, no
streams. Math calls its ops through ``ops`` (``dataflow_training.ops``: attention, norms,
GELU, ...) so kernel packages can swap implementations in. The training plugin packs each layer's parameters into one object ``W_<layer>``
(and gradients into ``dW_<layer>``, optimizer state into ``O_<layer>``, saved activations
into ``A_<layer>``) and hands the math views of those bytes, named as declared here.

Shapes are fixed by the config and the ``batch`` x ``seq_len`` of a training step, so
every object of the lowered Program has an exact size.

Layers, in chain order: one ``embed`` layer, the blocks, one ``head`` layer. The head's
task is fused: final norm, output projection, loss and their backward, over token chunks,
so no tokens x vocab tensor ever exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from dataflow_training.ops import Ops

Tensors = Mapping[str, Any]  # name -> torch.Tensor


@attrs.frozen
class TensorSpec:
    """One named tensor of a layer: a parameter, or a saved activation.

    ``decay`` (parameters only): whether weight decay applies (off for norms and biases).
    ``dtype`` is the storage dtype *before* the dtype policy: ``"param"`` means "whatever
    the policy gives parameters", a concrete name (``"int64"``) is kept as is.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str = "param"
    decay: bool = True


@attrs.frozen
class LayerSpec:
    """One layer of the chain. ``name`` is unique (``"emb"``, ``"0"`` ... ``"head"``) and
    is the suffix of its objects (``W_0``); ``kind`` selects its math (``"embed"``,
    ``"head"``, or a block kind such as ``"block"``)."""

    name: str
    kind: str
    params: tuple[TensorSpec, ...] = attrs.field(converter=tuple)


@runtime_checkable
class EmbedMath(Protocol):
    """Tokens to the first hidden state, and the gradient of its parameters."""

    def forward(self, config: Any, params: Tensors, tokens: Any, ops: Ops) -> Any:
        """``tokens`` int64 (batch, seq_len) -> hidden (batch, seq_len, hidden)."""

    def backward(self, config: Any, tokens: Any, d_hidden: Any, ops: Ops) -> Tensors:
        """Gradients of the embed parameters, by name (shapes as declared). The weights
        themselves are not passed: an embedding's gradient needs only tokens and
        d_hidden, so the weights need not be resident for this task."""


@runtime_checkable
class BlockMath(Protocol):
    """One block kind: forward saves ``saved_specs``; backward uses only those, the
    block's input and parameters; recompute re-derives the saved tensors from the input."""

    def saved_specs(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        """What forward saves for backward (the contents of ``A_<layer>``), exact shapes."""

    def forward(self, config: Any, params: Tensors, x: Any, ops: Ops) -> tuple[Any, Tensors]:
        """``x`` (batch, seq_len, hidden) -> (y of the same shape, saved tensors by name)."""

    def recompute(self, config: Any, params: Tensors, x: Any, ops: Ops) -> Tensors:
        """The saved tensors again, from the input alone (equal to what forward saved)."""

    def backward(
        self, config: Any, params: Tensors, x: Any, saved: Tensors, dy: Any, ops: Ops
    ) -> tuple[Any, Tensors]:
        """-> (dx, parameter gradients by name)."""


@runtime_checkable
class HeadMath(Protocol):
    """Final norm, output projection and loss, forward and backward in one call."""

    def forward_backward(
        self,
        config: Any,
        params: Tensors,
        embed_params: Tensors,
        x: Any,
        targets: Any,
        chunk_tokens: int,
        ops: Ops,
    ) -> tuple[Any, Any, Tensors, Tensors]:
        """-> (mean loss over the batch's tokens (a 0-d tensor), dx, head parameter
        gradients, embed parameter gradients (non-empty only when the head uses a tied
        embedding)). Processes ``chunk_tokens`` tokens at a time: no (tokens, vocab)
        tensor is ever made for more than one chunk."""


@runtime_checkable
class Family(Protocol):
    """A model family: configs, layers, math, the reference model, checkpoints."""

    name: str
    presets: Mapping[str, Any]

    def config(self, preset: str, **overrides: Any) -> Any:
        """The config of a preset, with fields overridden (unknown preset or field: an
        error naming it and the known ones)."""

    def layers(self, config: Any) -> list[LayerSpec]:
        """Every layer in chain order: embed, blocks, head."""

    def hidden_shape(self, config: Any, batch: int, seq_len: int) -> tuple[int, ...]:
        """Shape of a hidden state between layers."""

    def math(self, kind: str) -> EmbedMath | BlockMath | HeadMath:
        """The math of a layer kind."""

    def tied(self) -> bool:
        """Whether the head reuses the embed layer's weight (its gradient then also flows
        into ``dW_emb``)."""

    def reference_model(self, config: Any) -> Any:
        """An isolated plain-autograd ``torch.nn.Module`` (no dataflow imports, plain torch
        ops, not ``ops``) that is the truth. Its ``state_dict()`` keys are
        ``f"{layer.name}.{param.name}"`` for every declared parameter (a tied weight once,
        under the embed layer), and ``model(tokens, targets)`` returns the mean loss."""

    # Families with a public checkpoint format also provide (detected with hasattr):
    #   import_hf(path) -> (config, state)        state keys as in reference_model
    #   export_hf(config, state, path) -> None    writes safetensors + config.json
