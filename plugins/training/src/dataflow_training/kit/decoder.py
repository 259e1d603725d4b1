"""The shape of a decoder: its architecture (the block of each layer kind, composed of parts)
and its config (sizes, under HF's field names), and its layers.

A decoder here is: a token embedding (no positions), ``num_hidden_layers`` blocks, a
final RMSNorm and an output projection that is its own weight or the token embedding
(``tie_word_embeddings``). What a block is, is its parts (``block.Block``: a norm kind, an
attention, an FFN; ``parts.py``), and which block each layer is, the architecture's
(``Decoder``): one kind for every layer, or a kind per HF ``layer_types`` entry (full and
sliding-window attention, layer by layer). A config class names its architecture
(``DecoderConfig.architecture``, a class attribute: Llama's by default), so a config says
what model it is wherever it goes (the math, the reference, the HF key table, a
benchmark's stock model).

Field names are those of HF's ``LlamaConfig`` / ``Qwen3Config``, so a config reads like the
``config.json`` it comes from; ``rope_scaling`` is Llama 3.1's frequency scaling (None:
plain RoPE). Parameter names inside a layer are HF's too (``self_attn.q_proj.weight``),
every projection stored ``(out, in)`` as HF stores it. The embedding's and head's math is
``decoder_math.py``; a plain-torch reference is ``decoder_reference.py``; the HF key table
and ``config.json`` fields are ``decoder_hf.py``; a whole family is ``decoder_family.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from math import prod
from types import MappingProxyType
from typing import Any, ClassVar

import attrs

from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder_math import (
    EMBED_WEIGHT,
    FINAL_NORM,
    LM_HEAD,
    vocab_multiple_field,
    vocab_table,
)
from dataflow_training.kit.decoder_reference import Block as ReferenceBlock
from dataflow_training.kit.norms import Norm
from dataflow_training.kit.rotary import Llama3Scaling
from dataflow_training.step.family import LayerSpec, TensorSpec

EMBED = "emb"
HEAD = "head"
#: HF's layer types (``layer_types`` of its configs) that a decoder's blocks may be
#: (``chunked_attention``: Llama 4's, a query seeing its own chunk of the sequence;
#: ``linear_attention``: Gated DeltaNet's, Qwen 3.5's, ``linear_attention.py``)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
_CHAIN_KINDS = ("embed", "head")


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder's architecture: ``blocks``, its block kinds (kind name -> ``Block``; the
    first is every layer's unless ``layer_types`` says otherwise), and ``layer_types``,
    where layers mix kinds as HF's ``layer_types`` does: HF layer type -> block kind,
    read from the config's ``layer_types`` field (None there: every layer the first
    kind). Qwen 3's is ``{"full_attention": "block", "sliding_attention":
    "sliding_block"}``. ``norm``: the head's final norm (an RMSNorm; ``Norm(offset=1.0)``
    where it scales by ``1 + w``)."""

    blocks: Mapping[str, Block]
    layer_types: Mapping[str, str] | None = None
    norm: Norm = Norm()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", MappingProxyType(dict(self.blocks)))
        if not self.blocks or set(self.blocks) & set(_CHAIN_KINDS):
            raise ValueError(
                f"a decoder needs block kinds other than {', '.join(_CHAIN_KINDS)}; "
                f"got {', '.join(self.blocks) or 'none'}"
            )
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", MappingProxyType(dict(self.layer_types)))
            unknown = sorted(set(self.layer_types.values()) - set(self.blocks))
            if unknown or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(
                    f"layer types {dict(self.layer_types)} must map some of "
                    f"{', '.join(LAYER_TYPES)} to block kinds of {', '.join(self.blocks)}"
                )

    @property
    def ops(self) -> tuple[str, ...]:
        """Every op the blocks call."""
        return tuple(dict.fromkeys(op for block in self.blocks.values() for op in block.ops))

    def kinds(self, config: Any) -> list[str]:
        """The block kind of every layer of ``config``, in order."""
        first = next(iter(self.blocks))
        types = None if self.layer_types is None else config.layer_types
        if types is None:
            return [first] * config.num_hidden_layers
        return [self.layer_types[kind] for kind in types]

    def leaders(self, config: Any) -> list[int | None]:
        """For every layer, the earlier layer whose selection it reads (GLM 5's
        shared-index layers, ``LayerSpec.leader``), or None: none here."""
        return [None] * config.num_hidden_layers

    def block_of(self, config: Any, layer: int) -> Block:
        return self.blocks[self.kinds(config)[layer]]

    def reference_block(self, config: Any, layer: int) -> ReferenceBlock:
        """The plain-torch module of block ``layer`` (``DecoderReference`` asks)."""
        return self.block_of(config, layer).reference(config)

    def check(self, config: Any) -> None:
        """``config``'s ``layer_types``, where the architecture reads them: one per layer,
        each one it maps, and a window set for every windowed kind a layer is."""
        if self.layer_types is None or config.layer_types is None:
            return
        name = type(config).__name__
        types = config.layer_types
        if len(types) != config.num_hidden_layers:
            raise ValueError(
                f"{name}.layer_types has {len(types)} entries; {name}.num_hidden_layers is "
                f"{config.num_hidden_layers}"
            )
        unknown = sorted(set(types) - set(self.layer_types))
        if unknown:
            raise ValueError(
                f"{name}.layer_types has {unknown}: known layer types are "
                f"{', '.join(self.layer_types)}"
            )
        for kind in sorted(set(types)):
            window = self.blocks[self.layer_types[kind]].attention.window
            if window is not None and getattr(config, window) is None:
                raise ValueError(
                    f"{name}.layer_types has {kind!r} layers but {name}.{window} is None"
                )


def _positive(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive int, got {value!r}"
        )


def _positive_float(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive number, got {value!r}"
        )


def flag(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    """An attrs validator for a config's bool field: True or False, nothing truthy."""
    if not isinstance(value, bool):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be True or False, got {value!r}"
        )


def _scaling(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, Llama3Scaling):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be None or a Llama3Scaling, "
            f"got {value!r}"
        )


def _as_scaling(value: object) -> object:
    """A ``Llama3Scaling`` from its fields as a mapping too: overrides travel through the
    lowered program's JSON metadata, where the record is a plain object."""
    if isinstance(value, Mapping):
        try:
            return Llama3Scaling(**value)
        except TypeError as error:
            raise ValueError(f"rope_scaling {dict(value)!r}: {error}") from None
    return value


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _as_layer_types(value: object) -> object:
    """A tuple of names from a list too (overrides travel as JSON)."""
    return tuple(value) if isinstance(value, list) else value


def _layer_types(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (
        not isinstance(value, tuple) or not all(isinstance(kind, str) for kind in value)
    ):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be None or a list of layer "
            f"types, got {value!r}"
        )


def sliding_window_field() -> Any:
    """The config field ``sliding_window: int | None = None`` (HF's name): the tokens a
    sliding-window attention's query sees, counting itself (None: no window)."""
    return attrs.field(default=None, kw_only=True, validator=_optional_positive)


def layer_types_field(default: Any = None) -> Any:
    """The config field ``layer_types: tuple[str, ...] | None = None`` (HF's name): each
    layer's type (``LAYER_TYPES``), which the architecture maps to block kinds (None:
    every layer the architecture's first kind). ``default``: another default (an
    ``attrs.Factory`` of the layer count, say)."""
    return attrs.field(
        default=default, kw_only=True, converter=_as_layer_types, validator=_layer_types
    )


def _default_head_dim(config: Any) -> int:
    return config.hidden_size // config.num_attention_heads


@attrs.frozen
class DecoderConfig:
    """Sizes of a decoder (see the module docstring). ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``; Qwen 3 sets it apart (128 at every size).
    ``architecture`` (a class attribute) is what the model is made of: by default
    Llama's, every layer a ``Block()`` (RMSNorm, causal grouped-query attention with
    RoPE, the dense SwiGLU); a family's config class names its own."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_hidden_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    max_position_embeddings: int = attrs.field(validator=_positive)
    rope_theta: float = attrs.field(validator=_positive_float)
    rms_norm_eps: float = attrs.field(validator=_positive_float)
    tie_word_embeddings: bool = attrs.field(validator=flag)
    head_dim: int = attrs.field(
        default=attrs.Factory(_default_head_dim, takes_self=True), validator=_positive
    )
    rope_scaling: Llama3Scaling | None = attrs.field(
        default=None, converter=_as_scaling, validator=_scaling
    )
    #: the step stores the token table and the output projection with their rows rounded
    #: up to a multiple of it (``decoder_math.padded_vocab``; 1: as they are)
    vocab_multiple: int = vocab_multiple_field()
    #: the parts of the model: a property of the architecture, named by a family's config
    #: class, not a field a preset or an override changes
    architecture: ClassVar[Decoder] = Decoder({"block": Block()})

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"{name}.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim ({self.head_dim}) must be even (rotary pairs)")
        self.architecture.check(self)

    @property
    def q_width(self) -> int:
        """Width of the query projection, ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key and of the value projection."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in attrs.fields(cls))

    def with_overrides(self, **overrides: Any) -> Any:
        """A copy with fields replaced; an unknown field is an error naming the known ones.
        ``head_dim`` follows a new width or head count unless it is overridden too (or the
        preset sets it apart from ``hidden_size // num_attention_heads``)."""
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} has no field(s) {', '.join(map(repr, unknown))}; "
                f"known fields: {', '.join(self.field_names())}"
            )
        if "head_dim" not in overrides and self.head_dim == _default_head_dim(self):
            hidden = overrides.get("hidden_size", self.hidden_size)
            heads = overrides.get("num_attention_heads", self.num_attention_heads)
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                overrides["head_dim"] = hidden // heads
        return attrs.evolve(self, **overrides)


# -- layers ----------------------------------------------------------------------------


def head_params(config: DecoderConfig) -> tuple[TensorSpec, ...]:
    """The final norm, and the output projection unless it is the embedding's (tied)."""
    norm = TensorSpec(FINAL_NORM, (config.hidden_size,), decay=False)
    if config.tie_word_embeddings:
        return (norm,)
    return (norm, vocab_table(config, LM_HEAD))


def layer_specs(config: DecoderConfig) -> list[LayerSpec]:
    """``emb``, blocks ``"0"`` .. ``str(num_hidden_layers - 1)`` (each of its kind, by the
    config's architecture), ``head``: the chain's order. A tied head reads the embedding's
    weight as its ``lm_head.weight``."""
    architecture = config.architecture
    embed = vocab_table(config, EMBED_WEIGHT)
    tied = {LM_HEAD: f"{EMBED}.{EMBED_WEIGHT}"} if config.tie_word_embeddings else {}
    leaders = architecture.leaders(config)
    blocks = [
        architecture.blocks[kind].layer(config, str(layer), kind)
        for layer, kind in enumerate(architecture.kinds(config))
    ]
    blocks = [
        block if leader is None else attrs.evolve(block, leader=str(leader))
        for block, leader in zip(blocks, leaders, strict=True)
    ]
    return [
        LayerSpec.single(EMBED, "embed", (embed,)),
        *blocks,
        LayerSpec.single(HEAD, "head", head_params(config), tied=tied),
    ]


def expected_state(
    config: DecoderConfig, layers: list[LayerSpec] | None = None
) -> dict[str, tuple[int, ...]]:
    """State key (``f"{layer}.{param}"``) -> shape of every parameter in the model state
    (the real vocabulary's rows, ``TensorSpec.state_shape``), in chain order (of
    ``layers``; default the config's)."""
    return {
        f"{layer.name}.{param.name}": param.state_shape
        for layer in (layer_specs(config) if layers is None else layers)
        for param in layer.params
    }


def parameter_count(config: DecoderConfig) -> int:
    """Number of parameters (the real vocabulary's), a tied output projection counted
    once (as the embedding)."""
    return sum(prod(shape) for shape in expected_state(config).values())
