"""A stand-in inference engine: transformers' ``generate`` sampling from an HF checkpoint
folder, keeping the hidden states it computed on the way (``output_hidden_states``) and
the logits it sampled from (``output_logits``), written as rollouts.

It samples at temperature 1 with no top-k/top-p cut, so the behaviour log-probs are the
model's own. ``generate`` reports, for each decoding step, the hidden states of the tokens
that step fed in: the prompt's at the first step, one token's at each later one. Entry
``l`` (``l < L``) is the input of block ``l``; entry ``L`` is after the final norm, so the
update rebuilds the last block's output itself. Joined over the steps they cover
positions ``0 .. T - 2``: the last sampled token is never fed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dataflow_rl_example.rollouts import Rollouts

Reward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def low_token_reward(tokens: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """A toy reward: the fraction of a row's completion tokens in the lower half of the
    vocabulary (ids below 128). Rows: float32 (B,)."""
    completion = completion_mask.float()
    low = (tokens < 128).float() * completion
    return low.sum(-1) / completion.sum(-1).clamp(min=1)


def load_model(folder: str | Path) -> Any:
    """The HF checkpoint in ``folder`` as a float32 transformers model, in eval mode."""
    from transformers import AutoModelForCausalLM  # optional: only the stand-in needs it

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def generate_rollouts(
    model: Any,
    prompts: torch.Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    reward: Reward = low_token_reward,
    hidden_layers: Sequence[int] | None = None,
    reference: Any = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
) -> Rollouts:
    """Sample ``group_size`` completions of each prompt (``prompts`` int64 (P, prompt_len),
    all of one length) and return them as rollouts. ``hidden_layers``: the blocks whose
    inputs to keep (None: every block). ``reference``: the frozen reference model whose
    log-probs the KL term needs (None: no ``ref_logprobs``). A row ends at its first
    ``eos_token_id`` (kept, scored); what ``generate`` pads after it is padding."""
    from transformers import GenerationConfig

    layers = model.config.num_hidden_layers
    kept = list(range(layers)) if hidden_layers is None else sorted(set(hidden_layers))
    if any(not 0 <= layer < layers for layer in kept):
        raise ValueError(f"hidden_layers {kept}: the model has blocks 0..{layers - 1}")
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        output_hidden_states=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    torch.manual_seed(seed)
    inputs = prompts.repeat_interleave(group_size, 0)
    out = model.generate(inputs, generation_config=config)
    tokens = out.sequences
    rows, length = tokens.shape
    prompt_len = inputs.shape[1]

    completion = torch.zeros(rows, length, dtype=torch.bool)
    completion[:, prompt_len:] = True
    if eos_token_id is not None:  # a row ends at its first eos, which it keeps
        is_eos = (tokens == eos_token_id) & completion
        after = (is_eos.int().cumsum(-1) - is_eos.int()) > 0
        completion &= ~after
    prompt = torch.zeros_like(completion)
    prompt[:, :prompt_len] = True

    behaviour = torch.zeros(rows, length)
    for index, logits in enumerate(out.logits):  # step index samples token prompt_len + index
        position = prompt_len + index
        logp = logits.float().log_softmax(-1)
        behaviour[:, position] = logp.gather(1, tokens[:, position, None]).squeeze(1)
    behaviour *= completion

    hidden = {
        layer: torch.cat([step[layer] for step in out.hidden_states], dim=1)[:, : length - 1]
        for layer in kept
    }
    ref = None
    if reference is not None:
        logits = reference(tokens[:, :-1]).logits.float().log_softmax(-1)
        ref = torch.zeros(rows, length)
        ref[:, 1:] = logits.gather(2, tokens[:, 1:, None]).squeeze(2)
        ref *= completion
    groups = torch.arange(prompts.shape[0]).repeat_interleave(group_size)
    return Rollouts(
        tokens=tokens,
        prompt_mask=prompt,
        completion_mask=completion,
        behaviour_logprobs=behaviour,
        rewards=reward(tokens, completion).float(),
        groups=groups,
        hidden={layer: h.float().contiguous() for layer, h in hidden.items()},
        ref_logprobs=ref,
    )
