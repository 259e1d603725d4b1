"""Training phases (``dataflow train --phase``, ``drive.phases``) on llama3_tiny and the
CPU: a run that trains part of the model, then more, compiles each phase once, records
the phase in its checkpoints, and resumed across a boundary (from either side of it)
gives the same losses and weights, bit for bit, as a run that was never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from dataflow_training.drive.checkpoint import read_checkpoint
from dataflow_training.drive.phases import (
    Phase,
    carried_state,
    phase_at,
    phases_of,
    run_phases,
)
from dataflow_training.drive.values import state_layouts
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")

#: the blocks and embedding frozen for 3 steps, then only the embedding for 3, then nothing
PHASES = ("--freeze", "embed", "--freeze", "layers", "--phase", "3:embed", "--phase", "6:")


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "llama3_tiny", "--steps", str(steps), "--batch", "2",
        "--seq-len", "16", "--ga-rounds", "1", "--device", "cpu", "--lr", "3e-3",
        "--schedule", "constant", "--checkpoint-every", "2", "--out", str(out), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_phases_parse_and_order() -> None:
    assert Phase.parse("100:") == Phase(100, ())
    assert Phase.parse("5:embed, layers.0-3") == Phase(5, ("embed", "layers.0-3"))
    phases = run_phases(("embed",), phases_of(["9:", {"start": 4, "freeze": ["head"]}]))
    assert [p.start for p in phases] == [0, 4, 9]
    assert [phase_at(phases, done) for done in (0, 3, 4, 8, 9, 50)] == [0, 0, 1, 1, 2, 2]
    for bad in ("100", "x:embed"):
        with pytest.raises(ValueError, match="give START:PATTERNS"):
            Phase.parse(bad)
    with pytest.raises(ValueError, match="two phases start at step 4"):
        phases_of(["4:", "4:embed"])
    # config fields, typed as --value's; a recipe; the first phase given itself
    fields = Phase.parse("0:embed:rms_norm_eps=1e-3, tie_word_embeddings=false")
    assert fields == Phase(0, ("embed",), {"rms_norm_eps": 1e-3, "tie_word_embeddings": False})
    assert Phase.of(attrs.asdict(fields)) == fields  # as a checkpoint's options record it
    assert Phase.parse("0:@warm") == Phase(0, recipe="warm")
    assert [p.start for p in run_phases((), phases_of(["0:head", "5:"]))] == [0, 5]
    with pytest.raises(ValueError, match="--phase 0:... and --freeze both"):
        run_phases(("embed",), phases_of(["0:head"]))
    with pytest.raises(ValueError, match="'lr' is not FIELD=VALUE"):
        Phase.parse("3:embed:lr")
    with pytest.raises(ValueError, match="llama3 has no phase recipe 'warm' .*none"):
        run_phases((), phases_of(["0:@warm"]), load_family("llama3"))


def test_a_phase_sets_config_fields_and_refuses_one_that_changes_a_shape(tmp_path) -> None:
    """A phase's config fields make its step (here the norms' epsilon, which moves the
    loss and nothing's shape); one that changes a parameter's shape, or a field the config
    lacks, is one line before the run starts."""
    out = tmp_path / "run"
    result = invoke(*_args(out, 4, "--phase", "0::rms_norm_eps=0.5", "--phase", "2:"))
    assert result.exit_code == 0, result.output
    assert "phase 2 of 2, from step 3: frozen nothing" in result.output
    plain = tmp_path / "plain"
    assert invoke(*_args(plain, 4)).exit_code == 0
    phased, same = _losses(out), _losses(plain)
    assert phased[0] != same[0]  # eps 0.5 in the first phase
    wide = invoke(*_args(tmp_path / "wide", 2, "--phase", "1::intermediate_size=96"))
    assert_one_line_error(wide, 1, "--phase 1::intermediate_size=96", "change the model's")
    typo = invoke(*_args(tmp_path / "typo", 2, "--phase", "1::rms_norm_epz=0.5"))
    assert_one_line_error(typo, 1, "--phase 1::rms_norm_epz=0.5")


def test_a_resume_across_a_phase_boundary_equals_a_run_never_stopped(tmp_path) -> None:
    straight, out = tmp_path / "straight", tmp_path / "run"
    whole = invoke(*_args(straight, 8, *PHASES))
    assert whole.exit_code == 0, whole.output
    said = whole.output.splitlines()
    assert said.count("phase 2 of 3, from step 4: frozen embed") == 1, whole.output
    assert "phase 3 of 3, from step 7: frozen nothing" in said
    plans = [line for line in said if line.startswith("plan: ")]
    assert len(plans) == 3  # each phase compiled once
    trainable = [line.split("(trainable ")[1].split(")")[0] for line in plans]
    assert len(set(trainable)) == 3, plans
    metrics = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    predicted = [m["predicted_step_s"] for m in metrics]  # each phase's own plan's
    assert len({predicted[0], predicted[3], predicted[6]}) == 3, predicted

    # stopped at step 2 (phase 1), resumed to 4 (across the first boundary), then to 8
    assert invoke(*_args(out, 2, *PHASES)).exit_code == 0
    resumed = invoke(*_args(out, 4, "--resume", "auto"))  # the phases from the checkpoint
    assert resumed.exit_code == 0, resumed.output
    assert "phase 1 of 3, from step 1: frozen embed, layers" in resumed.output
    assert "phase 2 of 3, from step 4: frozen embed" in resumed.output
    # resumed at step 4, inside phase 2: it compiles phase 2 first
    again = invoke(*_args(out, 8, "--resume", "auto"))
    assert again.exit_code == 0, again.output
    assert again.output.count("plan: ") == 2 and "phase 2 of 3" in again.output

    assert _losses(out) == _losses(straight)
    for step, phase in ((2, 0), (4, 1), (8, 2)):
        mine, opt, manifest, _ = read_checkpoint(out / f"step_{step:06d}")
        theirs, their_opt, their_manifest, _ = read_checkpoint(straight / f"step_{step:06d}")
        assert manifest["phase"] == their_manifest["phase"] == phase
        assert mine.keys() == theirs.keys() and opt.keys() == their_opt.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (step, name)
        for name in opt:
            assert torch.equal(opt[name], their_opt[name]), (step, name)
    # the embedding, frozen until step 6, moved only after it
    first, _, _, _ = read_checkpoint(out / "step_000002")
    fourth, _, _, _ = read_checkpoint(out / "step_000004")
    last, _, _, _ = read_checkpoint(out / "step_000008")
    table = "emb.embed_tokens.weight"
    assert torch.equal(first[table], fourth[table]) and not torch.equal(fourth[table], last[table])


def test_a_checkpoint_of_another_phase_and_a_bad_phase_are_one_line(tmp_path) -> None:
    out = tmp_path / "run"
    assert invoke(*_args(out, 2, *PHASES)).exit_code == 0
    # the same folder resumed with phases that put step 2 in another phase
    other = invoke(*_args(out, 4, "--resume", "auto", "--phase", "1:embed"))
    assert_one_line_error(other, 1, "phase")
    bad = invoke(*_args(tmp_path / "bad", 2, "--phase", "3"))
    assert_one_line_error(bad, 2, "--phase", "START:PATTERNS")
    # a typo in a later phase is said before the run starts
    typo = invoke(*_args(tmp_path / "typo", 2, "--phase", "100:layrs"))
    assert_one_line_error(typo, 1, "--phase 100:layrs", "names no parameter")
    assert not (tmp_path / "typo" / "metrics.jsonl").exists()


def test_the_state_of_what_trains_on_carries_over_and_what_starts_is_zero() -> None:
    family = load_family("llama3")
    train = TrainConfig(seq_len=16, batch=2)
    before = lower(family, "llama3_tiny", attrs.evolve(train, freeze=("embed", "layers.0")))
    after = lower(family, "llama3_tiny", attrs.evolve(train, freeze=("layers.1",)))
    g = torch.Generator().manual_seed(0)
    opt = {  # the padding between entries too
        obj_id: torch.randint(0, 255, (layout.size_bytes,), dtype=torch.uint8, generator=g)
        for obj_id, layout in state_layouts(before).items()
    }
    carried = carried_state(before, opt, after)
    assert set(carried) == {"O_emb", "O_0", "O_head"}
    assert torch.equal(carried["O_head"], opt["O_head"])  # trains in both
    assert not carried["O_emb"].any() and not carried["O_0"].any()  # start training
    # a group partly frozen before: the entries it trained carry, the others start at zero
    part = lower(family, "llama3_tiny", attrs.evolve(train, freeze=("layers.0.self_attn.*",)))
    whole = lower(family, "llama3_tiny", train)
    layout = state_layouts(part)["O_0"]
    raw = torch.zeros(layout.size_bytes, dtype=torch.uint8)
    for view in layout.views(raw).values():
        view.normal_(generator=g)
    zeros = {
        k: torch.zeros(v.size_bytes, dtype=torch.uint8) for k, v in state_layouts(part).items()
    }
    carried = carried_state(part, {**zeros, "O_0": raw}, whole)["O_0"]
    had = layout.views(raw)
    for name, view in state_layouts(whole)["O_0"].views(carried).items():
        if name.startswith("self_attn."):
            assert not view.any(), name
        else:
            assert torch.equal(view, had[name]), name


@pytest.mark.gpu
def test_a_phased_run_on_cuda_moves_to_its_next_step(tmp_path) -> None:
    """On CUDA (bf16, graph replay): the first phase's engine is given back and the next
    phase's loaded; what the first froze moved only in the second."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow_training import TrainOptions, train

    options = TrainOptions(
        family="llama3",
        preset="llama3_tiny",
        steps=6,
        out=tmp_path / "run",
        batch=2,
        seq_len=16,
        device="cuda",
        checkpoint_every=3,
        freeze=("embed", "layers"),
        phases=[Phase(3, ())],
    )
    summary = train(options)
    assert summary["last"]["step"] == 6
    start, _, _, _ = read_checkpoint(options.out / "step_000003")
    end, _, manifest, _ = read_checkpoint(options.out / "step_000006")
    assert manifest["phase"] == 1
    assert not torch.equal(start["0.mlp.up_proj.weight"], end["0.mlp.up_proj.weight"])
