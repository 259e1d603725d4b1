"""The GPT-2 model config: sizes only, frozen.

GPT-2 as trained here: pre-norm blocks (LayerNorm -> causal self-attention -> residual,
LayerNorm -> MLP with the tanh GELU -> residual), learned absolute positions, a final
LayerNorm and an output projection tied to the token embedding. No dropout: training runs
with every dropout probability at 0, so forward, recompute and backward are deterministic
functions of the parameters and the input (HF exports say so in their config).
"""

from __future__ import annotations

from typing import Any

import attrs
from dataflow_training.kit import vocab_multiple_field


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPT2Config.{attribute.name} must be a positive int, got {value!r}")


def _positive_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"GPT2Config.{attribute.name} must be a positive number, got {value!r}")


@attrs.frozen
class GPT2Config:
    """Sizes of a GPT-2 model. The MLP is ``4 * n_embd`` wide, as in every GPT-2."""

    vocab_size: int = attrs.field(validator=_positive)
    n_positions: int = attrs.field(validator=_positive)
    n_embd: int = attrs.field(validator=_positive)
    n_layer: int = attrs.field(validator=_positive)
    n_head: int = attrs.field(validator=_positive)
    layer_norm_epsilon: float = attrs.field(default=1e-5, validator=_positive_float)
    #: ``wte`` is stored with its rows rounded up to a multiple of it (50,257 -> 50,304;
    #: the kit's ``padded_vocab``); 1 stores it as it is
    vocab_multiple: int = vocab_multiple_field()

    def __attrs_post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be a multiple of "
                f"GPT2Config.n_head ({self.n_head})"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    # The names the kit's parts read, as HF's GPT2Config maps them (its ``attribute_map``).
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions

    @property
    def n_inner(self) -> int:
        """Width of the MLP's hidden layer."""
        return 4 * self.n_embd

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in attrs.fields(cls))

    def with_overrides(self, **overrides: Any) -> GPT2Config:
        """A copy with fields replaced; an unknown field is an error naming the known ones."""
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise TypeError(
                f"GPT2Config has no field(s) {', '.join(map(repr, unknown))}; "
                f"known fields: {', '.join(self.field_names())}"
            )
        return attrs.evolve(self, **overrides)
