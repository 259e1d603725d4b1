"""Named GPT-2 configs: the four released sizes and a tiny one for CPU tests and demos.

The released sizes are OpenAI's GPT-2 (HF ``gpt2``, ``gpt2-medium``, ``gpt2-large``,
``gpt2-xl``): 50,257 tokens, 1,024 positions. ``gpt2_tiny`` is byte-sized (256 tokens),
2 layers of width 64, so a whole training step runs in milliseconds on a CPU.

``python -m dataflow_family_gpt2.presets`` prints the table of ``docs/builtin_models.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dataflow_family_gpt2.config import GPT2Config
from dataflow_family_gpt2.layers import parameter_count

_GPT2_VOCAB = 50257
_GPT2_CONTEXT = 1024

PRESETS: Mapping[str, GPT2Config] = MappingProxyType(
    {
        "gpt2_tiny": GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4),
        "gpt2_124m": GPT2Config(
            vocab_size=_GPT2_VOCAB, n_positions=_GPT2_CONTEXT, n_embd=768, n_layer=12, n_head=12
        ),
        "gpt2_350m": GPT2Config(
            vocab_size=_GPT2_VOCAB, n_positions=_GPT2_CONTEXT, n_embd=1024, n_layer=24, n_head=16
        ),
        "gpt2_774m": GPT2Config(
            vocab_size=_GPT2_VOCAB, n_positions=_GPT2_CONTEXT, n_embd=1280, n_layer=36, n_head=20
        ),
        "gpt2_1558m": GPT2Config(
            vocab_size=_GPT2_VOCAB, n_positions=_GPT2_CONTEXT, n_embd=1600, n_layer=48, n_head=25
        ),
    }
)

#: The HF hub model each released preset corresponds to (its weights import as is).
HF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "gpt2_124m": "openai-community/gpt2",
        "gpt2_350m": "openai-community/gpt2-medium",
        "gpt2_774m": "openai-community/gpt2-large",
        "gpt2_1558m": "openai-community/gpt2-xl",
    }
)


class UnknownPresetError(KeyError):
    """A preset name that is not one of ``PRESETS``."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def preset(name: str) -> GPT2Config:
    """The config of preset ``name``; an unknown name is an error listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown gpt2 preset {name!r}; known presets: {', '.join(PRESETS)}"
        ) from None


def preset_table() -> str:
    """The presets as a Markdown table, every number computed from the configs."""
    lines = [
        "| preset | layers | n_embd | heads | vocab | context | parameters | HF weights |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, config in PRESETS.items():
        hf = f"`{HF_NAMES[name]}`" if name in HF_NAMES else "-"
        lines.append(
            f"| `{name}` | {config.n_layer} | {config.n_embd} | {config.n_head} "
            f"| {config.vocab_size:,} | {config.n_positions:,} | {parameter_count(config):,} "
            f"| {hf} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(preset_table(), end="")
