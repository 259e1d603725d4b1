"""What a model family provides to the training plugin: family protocol v2.

A family plugin registers ``FamilySpec(name, description, load)`` through the
``dataflow_families`` hook; ``load()`` returns an object satisfying ``Family`` below.
Everything a family computes is plain torch on plain tensors: no dataflow objects, no
streams. Math calls its ops through ``env.ops`` (names documented in
``dataflow_training.step.ops``; a family may call op names of its own, listed in
``Family.ops``) so kernel packages can swap implementations in.

The chain: one ``embed`` layer, blocks of one or more block kinds in any order (dense and
MoE, linear and full attention), one ``head`` layer. For each layer the lowering makes:

- one parameter object per parameter group, ``W_<layer>`` for the unnamed group and
  ``W_<layer>.<group>`` for a named one (MoE experts stream apart from attention), with
  its gradient ``dW_...`` and optimizer state ``O_...`` (trainable tensors only);
- ``Aux_<layer>`` when the layer declares ``aux`` tensors: persistent state, zeroed before
  round 0's forward, changed in place by every round's forward, read by the last round's
  backward (expert-load counts of a balance term over the whole step). With
  ``aux_scope="model"`` the layers of one kind share one such object, ``Aux_<kind>``
  (or, where layers of several kinds pool one state, ``Aux_<aux_key>`` that they name):
  zeroed by the first of them in round 0, added to by every one of their forwards in
  every round, read by every one of their last-round backwards (counts pooled over the
  layers, as transformers' balance term pools them);
- per step and round, ``A_...`` (what forward saves for backward, ``BlockMath.saved``) and
  ``AuxTemp_...`` (``BlockMath.aux_temp``: router choices, sparse-attention selections),
  which forward writes and recompute and backward read verbatim, never re-derived.

Shapes are fixed by the config and the ``batch`` x ``seq_len`` of a training step, so
every object of the lowered Program has an exact size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from dataflow import families
from dataflow_training.step.ops import Ops

Tensors = Mapping[str, Any]  # name -> torch.Tensor


class FamilyContractError(ValueError):
    """A family broke the contract; the message names the family, layer, task or tensor."""


@attrs.frozen
class TensorSpec:
    """One named tensor: a parameter, a saved activation, an AuxTemp or Aux entry.

    ``dtype`` is the storage dtype: ``"policy"`` means whatever the dtype policy gives this
    kind of object (parameters: ``policy.param``; saved activations: ``policy.activation``);
    a concrete name (``"float32"``, ``"int32"``) is kept as is.
    ``decay`` (parameters): whether weight decay applies (off for norms and biases).
    ``trainable`` (parameters): False for a frozen tensor, which gets no gradient and no
    optimizer state.
    ``rule`` (parameters): the name of an update rule that changes the tensor instead of a
    gradient (DeepSeek V3's expert selection bias, moved by a sign rule from its layer's
    expert loads): such a tensor is not trainable (no gradient, no optimizer state); the
    optimizer task of its group reads the layer's ``Aux`` and calls the block math's
    ``apply_rules(config, params, aux, env)`` after the group's update.
    ``rows`` (parameters): the rows the model's state holds where the step stores more,
    ``shape[0]`` (None: all of them): a vocabulary table padded for the tensor cores
    (``kit.decoder_math.padded_vocab``). The rows past ``rows`` start at zero, no math
    reads them into a result and none gives them a gradient, so they stay zero; the model
    state (checkpoints, HF files) has ``state_shape``, and ``drive.values`` pads and slices
    at that boundary.
    ``piece`` (parameters): ``(index, count)`` where the step stores the model state's
    tensor ``name`` in ``count`` equal pieces along its first dimension, each in a
    parameter group of its own, and this is piece ``index`` (rows ``index * shape[0]`` up
    to ``(index + 1) * shape[0]`` of the state's tensor): a layer's routed experts split
    into shards (``kit.moe.expert_shards``). The model state, checkpoints' weights and HF
    files hold the whole tensor (``state_shape``); ``drive.values`` cuts and joins.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str = "policy"
    decay: bool = True
    trainable: bool = True
    rows: int | None = attrs.field(default=None, kw_only=True)
    rule: str | None = attrs.field(default=None, kw_only=True)
    piece: tuple[int, int] | None = attrs.field(default=None, kw_only=True)

    @piece.validator
    def _piece(self, attribute: attrs.Attribute, value: tuple[int, int] | None) -> None:
        if value is not None and not (self.shape and 0 <= value[0] < value[1]):
            raise FamilyContractError(
                f"tensor {self.name!r}: piece={value!r} must be (index, count) with "
                "0 <= index < count, of a tensor with a first dimension"
            )

    @rule.validator
    def _rule(self, attribute: attrs.Attribute, value: str | None) -> None:
        if value is not None and self.trainable:
            raise FamilyContractError(
                f"tensor {self.name!r}: rule={value!r} updates it instead of a gradient, so "
                "it must be declared trainable=False"
            )

    @rows.validator
    def _rows(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and not (self.shape and 0 < value <= self.shape[0]):
            raise FamilyContractError(
                f"tensor {self.name!r}: rows={value!r} must be between 1 and its first "
                f"dimension, {self.shape[0] if self.shape else 'none'}"
            )

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The shape the model state holds (``rows``; a ``piece``'s whole tensor)."""
        if self.piece is not None:
            return (self.shape[0] * self.piece[1], *self.shape[1:])
        if self.rows is None:
            return self.shape
        return (self.rows, *self.shape[1:])

    @property
    def state_slice(self) -> slice:
        """The rows of the state's tensor this one stores (all of them but for a piece)."""
        if self.piece is None:
            return slice(None)
        start = self.piece[0] * self.shape[0]
        return slice(start, start + self.shape[0])


@attrs.frozen
class ParamGroup:
    """Parameters of one layer that live in one object. ``name`` is ``""`` for a layer's
    main group (object ``W_<layer>``) or a suffix (``"experts"`` -> ``W_<layer>.experts``).

    ``shard``: ``(index, count)`` for one of ``count`` expert shards of a layer whose
    block kind routes its experts apart (``BlockMath`` below): its tensors are ``piece``s,
    and its own forward and backward tasks (``efwd``, ``ebwd``) run the tokens routed to
    it, so that no task needs more than one shard's weights."""

    name: str
    params: tuple[TensorSpec, ...] = attrs.field(converter=tuple)
    shard: tuple[int, int] | None = attrs.field(default=None, kw_only=True)


#: ``LayerSpec.aux_scope``: the layer's own Aux object, or one per layer kind
AUX_SCOPES = ("layer", "model")


@attrs.frozen
class LayerSpec:
    """One layer of the chain.

    ``name`` is unique (``"emb"``, ``"0"`` ... ``"head"``) and is the suffix of its objects;
    ``kind`` selects its math (``"embed"``, ``"head"``, or a block kind such as ``"block"``
    or ``"moe"``). ``groups`` hold its parameters. ``aux`` declares persistent state:
    the layer's own (``Aux_<layer>``, ``aux_scope="layer"``) or one object that every
    layer of its kind shares (``Aux_<kind>``, ``aux_scope="model"``; those layers must
    declare the same tensors); ``aux_key`` names that shared object instead of the kind,
    so that layers of several kinds pool one state (``Aux_<aux_key>``: Qwen 3.5 MoE's
    linear- and full-attention blocks count their experts' loads in one ``Aux_moe``). ``tied`` (head only) maps a name the head's math uses to the
    ``"<layer>.<param>"`` it is tied to (GPT-2: ``{"wte": "emb.wte"}``): the head reads
    that parameter and its gradient flows into that layer's ``dW``. ``leader`` (a block
    that reads another layer's AuxTemp: GLM 5's shared-index layers) names the earlier
    block whose selection its tasks read under the role ``shared``, and whose KL target
    its backward adds into (``kit.dsa``); ``""`` for most layers.
    """

    name: str
    kind: str
    groups: tuple[ParamGroup, ...] = attrs.field(converter=tuple)
    aux: tuple[TensorSpec, ...] = attrs.field(default=(), converter=tuple)
    aux_scope: str = attrs.field(default="layer", kw_only=True)
    aux_key: str = attrs.field(default="", kw_only=True)
    tied: Mapping[str, str] = attrs.field(factory=dict, converter=dict, hash=False)
    leader: str = attrs.field(default="", kw_only=True)

    @aux_scope.validator
    def _scope(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in AUX_SCOPES:
            raise FamilyContractError(
                f"layer {self.name!r}: aux_scope must be one of {', '.join(AUX_SCOPES)}, "
                f"got {value!r}"
            )

    @property
    def aux_object(self) -> str | None:
        """The id of the Aux object this layer's tasks see, or None without Aux."""
        if not self.aux:
            return None
        if self.aux_scope == "model":
            return f"Aux_{self.aux_key or self.kind}"
        return f"Aux_{self.name}"

    @classmethod
    def single(cls, name: str, kind: str, params: Any, **fields: Any) -> LayerSpec:
        """A layer whose parameters are one group."""
        return cls(name, kind, (ParamGroup("", tuple(params)),), **fields)

    @property
    def params(self) -> tuple[TensorSpec, ...]:
        """Every parameter of every group, in declaration order."""
        return tuple(p for group in self.groups for p in group.params)


@attrs.frozen
class Work:
    """What one task of a layer does, for the cost model: floating-point operations and
    the bytes it moves through device memory besides its parameters (activations read and
    written). Parameters' bytes are added by the lowering, which knows their dtype.
    ``kernels``: how many kernels the task launches (0: not declared, priced as one), so
    a task of many small kernels is priced by its launch time where that dominates."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0


@attrs.frozen
class LayerCost:
    """A layer kind's work for one round of ``batch`` x ``seq_len`` tokens whose
    activations take ``act_bytes`` bytes an element (``cost(config, batch, seq_len,
    act_bytes)`` of each math object)."""

    forward: Work
    backward: Work
    recompute: Work | None = None  # None: the same as forward
    #: the work of each partial save's ``rederive`` (``BlockMath.partial_saves``), by name
    partial: Mapping[str, Work] = attrs.field(factory=dict, converter=dict, hash=False)


@attrs.frozen
class PartialSave:
    """A cheaper recompute a block kind offers beside the full one: forward keeps only the
    saved tensors named in ``keeps`` (its ``A`` holds just those), and right before backward
    the kind's ``rederive`` makes the others from the block input, the kept tensors, the
    parameters and AuxTemp, at the cost ``LayerCost.partial[name]`` declares. Worth
    declaring where the kept tensors are cheap to store and costly to derive (attention's)
    and the others the reverse (an MLP's pre-activations). ``name`` (lowercase letters,
    digits and ``_``) names the part re-derived (``"mlp"``) and ends the id of the object
    that holds it (``A_<step>_<round>_<block>.mlp``)."""

    name: str = attrs.field()
    keeps: tuple[str, ...] = attrs.field(converter=tuple)

    @name.validator
    def _name(self, attribute: attrs.Attribute, value: str) -> None:
        if not value or not all(c.islower() or c.isdigit() or c == "_" for c in value):
            raise FamilyContractError(
                f"partial save name {value!r}: use lowercase letters, digits and '_'"
            )


@attrs.frozen
class Env:
    """What a math function gets besides its tensors.

    ``ops``: implementations by op name. ``round_``/``rounds``: which accumulation round of
    the step this is. ``grad_scale``: the head multiplies every gradient it returns by it
    (``1 / rounds``: the step's loss is the mean over its rounds). ``chunk_tokens``: the
    head's token chunk; ``head_vocab_tiles``: the head makes its weight's gradient one
    vocabulary tile at a time (``chunked_cross_entropy(..., vocab_tiles=True)``: no
    float32 (vocab, dim) accumulator, one more logits matmul). ``aux``: the layer's
    ``Aux`` tensors (forward adds into them; the last round's backward reads them; shared
    by the layers of a kind with ``aux_scope="model"``); empty when the layer declares
    none or the task does not see them. ``shared``: the tensors of objects of other
    layers the task reads or writes (``LayerSpec.leader``: a shared-index layer's
    leader's selection, and the KL target its group's backwards add into; an object
    the task creates is zeroed before the math runs); empty for most layers.
    ``segments``: the round's ``kit.Segments`` (which sequence each token belongs to, and
    its position: padded or packed batches), or None (one sequence per row, positions
    from 0); a block's attention takes it. ``route_ids``: expert choices (tokens, k) a
    router takes instead of its own top-k, its weights still computed at them: what
    ``dataflow verify`` gives autograd's run of a block (the engine's AuxTemp ``ids``),
    so that a near tie ranked the other way by other rounding does not send a token to
    another expert on each side; None (every step) lets the router choose.
    ``head_grad_into``: the head's projection's 16-bit gradient views (a tuple, one a row
    piece) its chunks' products are added into (``TrainConfig.head_accumulate=
    "gradient"``): the head returns no gradient of its own for the projection then.
    """

    ops: Ops
    round_: int = 0
    rounds: int = 1
    grad_scale: float = 1.0
    chunk_tokens: int = 1024
    head_vocab_tiles: bool = False
    aux: Tensors = attrs.field(factory=dict, hash=False)
    shared: Tensors = attrs.field(factory=dict, hash=False)
    segments: Any = attrs.field(default=None, hash=False)
    route_ids: Any = attrs.field(default=None, hash=False)
    head_grad_into: Any = attrs.field(default=None, hash=False)

    @property
    def last_round(self) -> bool:
        return self.round_ == self.rounds - 1


@attrs.frozen(eq=False)
class RowGradient:
    """A gradient that is zero outside ``rows``: what an embedding's backward may return
    instead of a whole (vocab, dim) table (for Llama 3 8B a float32 table is 2.1 GB of
    workspace; its rows for one round's tokens are 134 MB).

    ``rows`` int64 (n,) may repeat a row, and every repeat carries the same value in
    ``values`` (n, *shape[1:]): that row's whole gradient. n is the round's token count, so
    the shapes are the same every step (a captured CUDA graph replays it) and writing a
    repeated row more than once writes the same bytes. ``shape`` is the whole gradient's.
    """

    rows: Any
    values: Any
    shape: tuple[int, ...] = attrs.field(converter=tuple)

    @classmethod
    def summed(cls, rows: Any, values: Any, shape: tuple[int, ...], dtype: Any) -> RowGradient:
        """The gradient whose row ``r`` is the sum, in ``dtype``, of ``values[i]`` over every
        ``i`` with ``rows[i] == r`` (an embedding's: rows are the tokens, values d_hidden)."""
        rows, order = rows.reshape(-1).sort()
        starts = rows.new_ones(rows.shape, dtype=bool)
        starts[1:] = rows[1:] != rows[:-1]
        segment = starts.cumsum(0) - 1  # each position's run of equal rows
        sums = values.new_zeros(values.shape, dtype=dtype)
        sums.index_add_(0, segment, values[order].to(dtype))
        return cls(rows, sums[segment], shape)

    def add_into(self, target: Any, first: int = 0) -> None:
        """``target`` += this gradient, each row summed in ``values``' dtype and rounded
        once to ``target``'s (as ``target.add_`` of a dense table would). ``target`` may
        be the rows from ``first`` on of the whole gradient (a table stored in row pieces,
        ``RowPieces``): the rows outside it are left alone."""
        if first == 0 and target.shape[0] == self.shape[0]:
            summed = target[self.rows].to(self.values.dtype).add_(self.values)
            target.index_put_((self.rows,), summed.to(target.dtype))
            return
        local, inside = self._local(target, first)
        old = target[local].to(self.values.dtype)
        self._write(target, local, inside, old.add(self.values).where(inside, old))

    def copy_into(self, target: Any, first: int = 0) -> None:
        """``target`` = this gradient (its rows from ``first`` on, as ``add_into``)."""
        target.zero_()
        if first == 0 and target.shape[0] == self.shape[0]:
            target.index_put_((self.rows,), self.values.to(target.dtype))
            return
        local, inside = self._local(target, first)
        self._write(target, local, inside, self.values.where(inside, 0))

    def _local(self, target: Any, first: int) -> tuple[Any, Any]:
        """Each row's index in ``target`` (the rows from ``first`` on), clamped into it,
        and (n, 1) whether it is inside."""
        local = self.rows - first
        inside = (local >= 0) & (local < target.shape[0])
        return local.clamp(0, target.shape[0] - 1), inside.unsqueeze(1)

    @staticmethod
    def _write(target: Any, local: Any, inside: Any, new: Any) -> None:
        """``target[local] = new`` for the rows inside; every row outside writes what the
        first row inside writes (or, with none inside, its own unchanged value), so that
        the writes to one index all carry the same bytes, as ``rows``' repeats do, and no
        index outside the rows given changes. No host synchronization: the shapes are the
        round's token count whatever the tokens."""
        # the first inside, or 0: a (1,) index, never a 0-dim one (indexing with a 0-dim
        # tensor reads it to the host, which a CUDA graph's capture refuses)
        pick = inside.squeeze(1).to(local.dtype).argmax().reshape(1)
        index = local.where(inside.squeeze(1), local.index_select(0, pick))
        target.index_put_((index,), new.where(inside, new.index_select(0, pick)).to(target.dtype))

    def dense(self) -> Any:
        """The whole gradient as one tensor of ``values``' dtype."""
        out = self.values.new_zeros(self.shape)
        out.index_put_((self.rows,), self.values)
        return out


@attrs.frozen
class RowPieces:
    """A table that the step stores in row pieces (``TrainConfig.vocab_pieces``,
    ``step.pieces``), as the embedding's and the head's math get it: ``pieces`` in row
    order, never joined (a joined copy would be one more table of workspace).
    ``table[index]`` gathers rows by an integer tensor (an embedding's lookup); an op that
    takes row pieces gets ``pieces`` (``chunked_cross_entropy``); the gradient comes back
    as a tuple with one tensor per piece, a ``RowGradient`` or a whole table."""

    pieces: tuple[Any, ...] = attrs.field(converter=tuple)

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.pieces), *self.pieces[0].shape[1:])

    @property
    def dtype(self) -> Any:
        return self.pieces[0].dtype

    @property
    def device(self) -> Any:
        return self.pieces[0].device

    def __getitem__(self, index: Any) -> Any:
        """The rows of ``index`` (an integer tensor of any shape), as ``table[index]``:
        each piece gathers every index (clamped into its rows) and keeps the ones inside
        it, so the shapes never depend on the values (nothing waits for the device)."""
        out, start = None, 0
        for piece in self.pieces:
            rows = piece.shape[0]
            local = index - start
            inside = ((local >= 0) & (local < rows)).reshape(
                *index.shape, *([1] * (piece.dim() - 1))
            )
            gathered = piece[local.clamp(0, rows - 1)]
            out = gathered if out is None else gathered.where(inside, out)
            start += rows
        return out


@runtime_checkable
class EmbedMath(Protocol):
    """Tokens to the first hidden state, and the gradient of its parameters."""

    def forward(self, config: Any, params: Tensors, tokens: Any, env: Env) -> Any:
        """``tokens`` int64 (batch, seq_len) -> hidden (batch, seq_len, hidden)."""

    def backward(self, config: Any, tokens: Any, d_hidden: Any, env: Env) -> Tensors:
        """Gradients of the embed parameters by name, each a tensor or a ``RowGradient``
        (the rows the tokens pick). The weights are not passed: an embedding's gradient
        needs only tokens and d_hidden, so they need not be resident."""

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        """Work of forward and backward."""


@runtime_checkable
class BlockMath(Protocol):
    """One block kind. Forward saves ``saved``; backward uses only those, the block's
    input, its parameters and its AuxTemp; recompute re-derives ``saved`` from the input
    and the AuxTemp that forward wrote (never re-deciding what AuxTemp holds).

    A kind may also offer partial saves (detected with hasattr; ``partial_saves`` below):
      ``partial_saves(config) -> tuple[PartialSave, ...]``: the ones it offers (the
      recompute planner offers the first; ``lower(partial=...)`` takes any);
      ``rederive(config, params, x, kept, aux_temp, env, partial) -> Tensors``: the saved
      tensors that partial save ``partial`` does not keep, from the block input, the
      ``kept`` ones, the parameters and AuxTemp (equal to what forward saves);
    and its ``cost`` then gives ``LayerCost.partial[name]`` for each.

    A kind whose backward adds the gradients of a loss term of its own (the DSA indexer's
    KL loss, which reaches only its own parameters) declares it (detected with hasattr):
      ``objective(config, params, x, aux_temp, env) -> 0-d tensor``: that term, written
      with ``env.ops`` so that autograd through it (``dataflow verify``'s task level, with
      differentiable ops) gives the gradients backward adds beyond ``dy``'s.

    A kind whose layers lead followers (``LayerSpec.leader``) declares the group's shared
    object (detected with hasattr):
      ``shared_target(config, batch, seq_len) -> tuple[TensorSpec, ...]``: the tensors
      of ``Target_s_r_<leader>``, which the followers' backwards add into (the
      last one's task zeroes it first) and the leader's backward reads as
      ``env.shared``; its followers' tasks see the leader's AuxTemp there too.

    A kind whose math takes a round's segments (``Env.segments``: padded or packed
    batches, ``TrainConfig.segments``) says so (detected with hasattr; an embedding
    too):
      ``refuses_segments(config) -> str | None``: None where its forward, recompute and
      backward honour ``env.segments`` (the kit's ``Block`` of a ``SelfAttention``; the
      kit's embedding without learned positions, which reads none), else the part that
      does not; the lowering refuses a segmented step naming it. A kind without the
      method is refused whole.
    """

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        """What forward saves for backward (the contents of ``A_...``), exact shapes."""

    def aux_temp(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        """What forward decides once and recompute and backward read verbatim (router
        assignments and weights, sparse-attention selections); ``()`` for none."""

    def forward(
        self, config: Any, params: Tensors, x: Any, env: Env
    ) -> tuple[Any, Tensors, Tensors]:
        """``x`` (batch, seq_len, hidden) -> (y of the same shape, saved, aux_temp).
        ``params`` holds every group's parameters by name."""

    def recompute(
        self, config: Any, params: Tensors, x: Any, aux_temp: Tensors, env: Env
    ) -> Tensors:
        """The saved tensors again, from the input and forward's AuxTemp."""

    def backward(
        self,
        config: Any,
        params: Tensors,
        x: Any,
        saved: Tensors,
        aux_temp: Tensors,
        dy: Any,
        env: Env,
    ) -> tuple[Any, Tensors]:
        """-> (dx, gradients of every trainable parameter by name)."""

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        """Work of forward, backward and recompute."""


@runtime_checkable
class HeadMath(Protocol):
    """Final norm, output projection and loss, forward and backward in one call."""

    def forward_backward(
        self, config: Any, params: Tensors, x: Any, targets: Any, env: Env
    ) -> tuple[Any, Any, Tensors]:
        """-> (mean loss over the round's scored tokens (0-d float32), dx, gradients by
        name). ``params`` holds the head's own parameters and, under their local names,
        the ones it is tied to (``LayerSpec.tied``); gradients are returned for all of
        them, multiplied by ``env.grad_scale``, each of its parameter's shape in its dtype
        or in float32 (a sum the task rounds once into its gradient object: the output
        projection's over chunks, ``kit.head``). Works ``env.chunk_tokens`` tokens at a
        time: no (tokens, vocab) tensor is made for more than one chunk."""

    def cost(self, config: Any, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        """Work of the fused task (``backward`` is included in ``forward``'s figure)."""


@runtime_checkable
class Family(Protocol):
    """A model family: configs, layers, math, the reference model, checkpoints."""

    name: str
    presets: Mapping[str, Any]
    #: every op name its math calls through ``env.ops``
    ops: tuple[str, ...]

    def config(self, preset: str, **overrides: Any) -> Any:
        """The config of a preset, with fields overridden (unknown preset or field: an
        error naming it and the known ones)."""

    def layers(self, config: Any) -> list[LayerSpec]:
        """Every layer in chain order: embed, blocks, head."""

    def hidden_shape(self, config: Any, batch: int, seq_len: int) -> tuple[int, ...]:
        """Shape of a hidden state between layers."""

    def math(self, kind: str) -> EmbedMath | BlockMath | HeadMath:
        """The math of a layer kind."""

    def reference_model(self, config: Any) -> Any:
        """An isolated plain-autograd ``torch.nn.Module`` (no dataflow imports, plain torch
        ops, not ``ops``) that is the truth. Its ``state_dict()`` keys are
        ``f"{layer.name}.{param.name}"`` for every declared parameter (a tied weight once,
        under the layer that owns it), and ``model(tokens, targets)`` returns the mean
        loss; a model whose layers declare ``aux`` takes a list of rounds instead (see
        ``dataflow_training.testing.toy_moe``)."""

    # Families with a public checkpoint format also provide (detected with hasattr):
    #   import_hf(path) -> (config, state)        state keys as in reference_model
    #   export_hf(config, state, path) -> None    writes safetensors + config.json


def partial_saves(math: Any, config: Any, saved: tuple[TensorSpec, ...]) -> dict[str, PartialSave]:
    """The partial saves block math ``math`` offers (``{}`` when it declares none), by name,
    checked against what it saves: each keeps a non-empty proper subset of ``saved``, and
    the kind has ``rederive``."""
    declare = getattr(math, "partial_saves", None)
    if declare is None:
        return {}
    found: dict[str, PartialSave] = {}
    names = [s.name for s in saved]
    for partial in declare(config):
        where = f"{type(math).__name__}: partial save {partial.name!r}"
        unknown = sorted(set(partial.keeps) - set(names))
        if unknown:
            raise FamilyContractError(
                f"{where} keeps {unknown}, which it does not save (saved: {', '.join(names)})"
            )
        if not partial.keeps or set(partial.keeps) == set(names):
            raise FamilyContractError(f"{where} must keep some but not all of {', '.join(names)}")
        if partial.name in found:
            raise FamilyContractError(f"{where} is declared twice")
        if not callable(getattr(math, "rederive", None)):
            raise FamilyContractError(f"{where} is declared but the kind has no rederive")
        found[partial.name] = partial
    return found


def state_rows(layers: Any) -> dict[str, int]:
    """``{"<layer>.<param>": rows}`` of every parameter the state holds fewer rows of than
    the step stores (``TensorSpec.rows``)."""
    return {
        f"{layer.name}.{param.name}": param.rows
        for layer in layers
        for param in layer.params
        if param.rows is not None
    }


def stored_pieces(layers: Any) -> dict[tuple[str, str, str], TensorSpec]:
    """``{(layer, group, param): spec}`` of every parameter the step stores a piece of
    (``TensorSpec.piece``: an expert shard's share of the state's stacked experts, a
    vocabulary table's row piece)."""
    return {
        (layer.name, group.name, p.name): p
        for layer in layers
        for group in layer.groups
        for p in group.params
        if p.piece is not None
    }


def embed_layer(layers: list[LayerSpec] | tuple[LayerSpec, ...]) -> LayerSpec:
    return _only(layers, "embed")


def head_layer(layers: list[LayerSpec] | tuple[LayerSpec, ...]) -> LayerSpec:
    return _only(layers, "head")


def _only(layers: Any, kind: str) -> LayerSpec:
    found = [layer for layer in layers if layer.kind == kind]
    if len(found) != 1:
        raise FamilyContractError(f"a family has exactly one {kind!r} layer; found {len(found)}")
    return found[0]


def load_family(name: str) -> Family:
    """The registered family ``name``, loaded; a family object whose own ``name`` differs
    from the name it was registered under is an error naming both."""

    family = families().get(name).load()
    if getattr(family, "name", None) != name:
        raise FamilyContractError(
            f"family registered as {name!r} loads an object named {getattr(family, 'name', None)!r}"
        )
    return family
