"""The shape of a Llama-style decoder, and its layers: what Llama 3 and Qwen 3 share.

A decoder here is: a token embedding (no positions), ``num_hidden_layers`` pre-norm blocks
(RMSNorm -> grouped-query attention with rotary positions -> residual, RMSNorm -> SwiGLU ->
residual), a final RMSNorm and an output projection that is its own weight or the token
embedding (``tie_word_embeddings``). ``qk_norm`` adds Qwen 3's per-head RMSNorm on the
queries and keys (over ``head_dim``, one weight shared by the heads) before the rotation;
``rope_scaling`` is Llama 3.1's frequency scaling (None: plain RoPE). No biases, no dropout.

Field names are those of HF's ``LlamaConfig`` / ``Qwen3Config``, so a config reads like the
``config.json`` it comes from. Families subclass it (``Llama3Config``, ``Qwen3Config``) and
set the class attribute ``qk_norm``. Parameter names inside a layer are HF's too
(``self_attn.q_proj.weight``), every projection stored ``(out, in)`` as HF stores it. The
math is ``decoder_math.py``; a plain-torch reference is ``decoder_reference.py``; the HF key
table and ``config.json`` fields are ``decoder_hf.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from math import prod
from typing import Any, ClassVar

import attrs

from dataflow_training.family import LayerSpec, TensorSpec
from dataflow_training.kit.rotary import Llama3Scaling

EMBED = "emb"
HEAD = "head"
#: the embedding's weight, and the head's name for the output projection (tied or not)
EMBED_WEIGHT = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "norm.weight"


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


def _flag(instance: Any, attribute: attrs.Attribute, value: object) -> None:
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


def _default_head_dim(config: Any) -> int:
    return config.hidden_size // config.num_attention_heads


@attrs.frozen
class DecoderConfig:
    """Sizes of a Llama-style decoder (see the module docstring). ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``; Qwen 3 sets it apart (128 at every size)."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_hidden_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    max_position_embeddings: int = attrs.field(validator=_positive)
    rope_theta: float = attrs.field(validator=_positive_float)
    rms_norm_eps: float = attrs.field(validator=_positive_float)
    tie_word_embeddings: bool = attrs.field(validator=_flag)
    head_dim: int = attrs.field(
        default=attrs.Factory(_default_head_dim, takes_self=True), validator=_positive
    )
    rope_scaling: Llama3Scaling | None = attrs.field(
        default=None, converter=_as_scaling, validator=_scaling
    )
    #: per-head q/k RMSNorm: a property of the architecture, set by a family's subclass
    #: (Qwen 3), not a field a preset or an override changes
    qk_norm: ClassVar[bool] = False
    #: what the q/k norms normalise: ``"head"`` (Qwen 3: each head, one ``head_dim`` weight)
    #: or ``"projection"`` (OLMoE: the whole q and k projections, one weight per channel)
    qk_norm_scope: ClassVar[str] = "head"

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"{name}.num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim ({self.head_dim}) must be even (rotary pairs)")

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

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def attention_params(config: DecoderConfig) -> tuple[TensorSpec, ...]:
    """A block's parameters up to and including the second norm, in HF's order: what a
    dense and an MoE block share. Norm scales take no weight decay."""
    n, q, kv = config.hidden_size, config.q_width, config.kv_width
    attention = {"q_proj": (q, n), "k_proj": (kv, n), "v_proj": (kv, n), "o_proj": (n, q)}
    per_head = config.qk_norm_scope == "head"
    qk_norm = (
        (
            TensorSpec(
                "self_attn.q_norm.weight", (config.head_dim if per_head else q,), decay=False
            ),
            TensorSpec(
                "self_attn.k_norm.weight", (config.head_dim if per_head else kv,), decay=False
            ),
        )
        if config.qk_norm
        else ()
    )
    return (
        TensorSpec("input_layernorm.weight", (n,), decay=False),
        *(TensorSpec(f"self_attn.{p}.weight", attention[p]) for p in _ATTENTION),
        *qk_norm,
        TensorSpec("post_attention_layernorm.weight", (n,), decay=False),
    )


def block_params(config: DecoderConfig) -> tuple[TensorSpec, ...]:
    """One dense block's parameters, in HF's order."""
    n, inner = config.hidden_size, config.intermediate_size
    mlp = {"gate_proj": (inner, n), "up_proj": (inner, n), "down_proj": (n, inner)}
    return (
        *attention_params(config),
        *(TensorSpec(f"mlp.{p}.weight", mlp[p]) for p in _MLP),
    )


def head_params(config: DecoderConfig) -> tuple[TensorSpec, ...]:
    """The final norm, and the output projection unless it is the embedding's (tied)."""
    norm = TensorSpec(FINAL_NORM, (config.hidden_size,), decay=False)
    if config.tie_word_embeddings:
        return (norm,)
    return (norm, TensorSpec(LM_HEAD, (config.vocab_size, config.hidden_size)))


def layer_specs(
    config: DecoderConfig, block: Callable[[str], LayerSpec] | None = None
) -> list[LayerSpec]:
    """``emb``, blocks ``"0"`` .. ``str(num_hidden_layers - 1)``, ``head``: the chain's
    order. ``block(name)`` makes a block (default: a dense ``block``, ``block_params``).
    A tied head reads the embedding's weight as its ``lm_head.weight``."""
    if block is None:
        params = block_params(config)
        block = lambda name: LayerSpec.single(name, "block", params)  # noqa: E731
    embed = TensorSpec(EMBED_WEIGHT, (config.vocab_size, config.hidden_size))
    tied = {LM_HEAD: f"{EMBED}.{EMBED_WEIGHT}"} if config.tie_word_embeddings else {}
    return [
        LayerSpec.single(EMBED, "embed", (embed,)),
        *(block(str(layer)) for layer in range(config.num_hidden_layers)),
        LayerSpec.single(HEAD, "head", head_params(config), tied=tied),
    ]


def expected_state(
    config: DecoderConfig, layers: list[LayerSpec] | None = None
) -> dict[str, tuple[int, ...]]:
    """State key (``f"{layer}.{param}"``) -> shape of every parameter, in chain order
    (of ``layers``; default the dense decoder's)."""
    return {
        f"{layer.name}.{param.name}": param.shape
        for layer in (layer_specs(config) if layers is None else layers)
        for param in layer.params
    }


def parameter_count(config: DecoderConfig) -> int:
    """Number of parameters, a tied output projection counted once (as the embedding)."""
    return sum(prod(shape) for shape in expected_state(config).values())
