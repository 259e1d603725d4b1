"""The rollout format: written and read back unchanged; a malformed folder is one error
naming the file and the field."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from dataflow_rl_example import RolloutError, Rollouts, read_rollouts, write_rollouts
from dataflow_rl_example.rollouts import ROW_TENSORS


def rollouts(hidden_layers=(0, 1), ref=True):
    rows, length = 4, 6
    generator = torch.Generator().manual_seed(0)
    prompt = torch.zeros(rows, length, dtype=torch.bool)
    prompt[:, :2] = True
    completion = ~prompt
    completion[0, 4:] = False  # row 0 ends early: two tokens of padding
    return Rollouts(
        tokens=torch.randint(0, 256, (rows, length), generator=generator),
        prompt_mask=prompt,
        completion_mask=completion,
        behaviour_logprobs=-torch.rand(rows, length, generator=generator) * completion,
        rewards=torch.rand(rows, generator=generator),
        groups=torch.tensor([0, 0, 1, 1]),
        hidden={
            layer: torch.randn(rows, length - 1, 8, generator=generator) for layer in hidden_layers
        },
        ref_logprobs=-torch.rand(rows, length, generator=generator) if ref else None,
    )


@pytest.mark.parametrize(("hidden_layers", "ref"), [((0, 1), True), ((), False)])
def test_round_trip(tmp_path, hidden_layers, ref):
    written = rollouts(hidden_layers, ref)
    write_rollouts(written, tmp_path)
    index = json.loads((tmp_path / "rollouts.json").read_text())
    assert index["format"] == "dataflow-rl.rollouts/v1"
    assert index["hidden_layers"] == list(hidden_layers)
    back = read_rollouts(tmp_path)
    for field in (*ROW_TENSORS, "rewards", "groups"):
        assert torch.equal(getattr(back, field), getattr(written, field)), field
    assert back.hidden.keys() == written.hidden.keys()
    assert all(torch.equal(back.hidden[k], written.hidden[k]) for k in written.hidden)
    assert (back.ref_logprobs is None) == (not ref)


def test_left_padding_and_rows_without_a_prompt_are_refused(tmp_path):
    bad = rollouts()
    prompt = bad.prompt_mask.clone()
    prompt[1, 0] = False  # padding at the row's start
    with pytest.raises(RolloutError, match="right-padded"):
        write_rollouts(attrs.evolve(bad, prompt_mask=prompt), tmp_path)
    prompt, completion = bad.prompt_mask.clone(), bad.completion_mask.clone()
    prompt[1, :2], completion[1, :2] = False, True  # the whole row generated: no prompt
    with pytest.raises(RolloutError, match="every row starts with at least one prompt token"):
        attrs.evolve(bad, prompt_mask=prompt, completion_mask=completion).check()


def test_a_hidden_state_of_the_wrong_length_is_named(tmp_path):
    bad = rollouts()
    hidden = dict(bad.hidden) | {1: torch.zeros(4, 6, 8)}
    with pytest.raises(RolloutError, match=r"'hidden\.1' must be \(rows, tokens - 1, hidden\)"):
        attrs.evolve(bad, hidden=hidden).check()


def test_a_missing_tensor_or_index_is_named(tmp_path):
    with pytest.raises(RolloutError, match="no rollout index"):
        read_rollouts(tmp_path)
    write_rollouts(rollouts(), tmp_path)
    index = json.loads((tmp_path / "rollouts.json").read_text())
    index["hidden_layers"] = [0, 1, 2]
    (tmp_path / "rollouts.json").write_text(json.dumps(index))
    with pytest.raises(RolloutError, match=r"missing tensor\(s\) hidden\.2"):
        read_rollouts(tmp_path)
    (tmp_path / "rollouts.json").write_text(json.dumps(index | {"format": "other/v9"}))
    with pytest.raises(RolloutError, match="'format' must be 'dataflow-rl.rollouts/v1'"):
        read_rollouts(tmp_path)
