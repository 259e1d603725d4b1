"""The lr schedule of a run (``dataflow_training.drive.schedule``): its shapes, and what a
resume does with it, in Python and in real ``dataflow train`` runs of gpt2_tiny on the CPU:
a longer ``--steps`` goes on without a jump and says so, a changed ``--lr`` is refused
without ``--reset-schedule`` and starts a new schedule with it, and a run resumed from a
checkpoint of its extension or of its new schedule repeats the same lrs and losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from dataflow_training.drive.schedule import (
    LrSchedule,
    Phase,
    ScheduleChange,
    resumed,
    stored_schedule,
)

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")


def _options(steps: int, **shape) -> SimpleNamespace:
    return SimpleNamespace(
        steps=steps,
        **{"lr": 1.0, "warmup": 2, "schedule": "cosine", "min_lr_ratio": 0.1, **shape},
    )


@pytest.mark.parametrize(
    ("schedule", "steps", "expected"),
    [
        # warmup 2 to lr 1, then over steps 2..5 (span 3) a cosine to 0.1:
        # 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2 for k = 0..3
        ("cosine", 6, [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]),
        # stable at 1 until 80 % of steps 2..11 (span 9) are done, then linear to 0.1:
        # step 10 is 8/9 of the way, 4/9 into the decay: 1 - 0.9 * 4/9 = 0.6
        ("wsd", 12, [0.5, 1.0, *[1.0] * 8, 0.6, 0.1]),
        ("constant", 4, [0.5, 1.0, 1.0, 1.0]),
    ],
)
def test_lr_schedules_and_their_constant_tail(schedule, steps, expected):
    lr = LrSchedule.of(_options(steps, schedule=schedule))
    assert [lr.lr_at(step) for step in range(steps)] == pytest.approx(expected, abs=1e-12)
    assert [lr.lr_at(step) for step in range(steps, steps + 3)] == [lr.lr_at(steps - 1)] * 3


def test_a_short_run_past_its_warmup_holds_its_last_lr():
    lr = LrSchedule.of(_options(2, warmup=4))
    assert [lr.lr_at(step) for step in range(4)] == [0.25, 0.5, 0.5, 0.5]


def test_what_a_resume_does_with_the_schedule():
    stored = LrSchedule.of(_options(10))
    assert LrSchedule.from_json(json.loads(json.dumps(stored.to_json()))) == stored
    same, line = resumed(stored, _options(10), 6, reset=False)
    assert same == stored and line is None
    # longer, from the end: the lr the schedule ends on, at once
    same, line = resumed(stored, _options(14), 10, reset=False)
    assert same == stored and "stays at 0.1, where the schedule ends, without a jump" in line
    # longer, from partway: the rest of the schedule, then that lr
    _, line = resumed(stored, _options(14), 6, reset=False)
    assert "follows it to step 10, then stays at 0.1" in line
    # at the end of its --steps already: nothing to train, nothing to say
    assert resumed(stored, _options(14), 14, reset=False) == (stored, None)
    # shorter: it stops partway along the schedule
    _, line = resumed(stored, _options(8), 6, reset=False)
    assert "--steps 8 stops before the end of the run's schedule (step 10)" in line
    for name, option, value in (
        ("lr", "--lr", 0.5),
        ("warmup", "--warmup", 0),
        ("schedule", "--schedule", "wsd"),
        ("min_lr_ratio", "--min-lr-ratio", 0.0),
    ):
        with pytest.raises(ScheduleChange, match=f"^{option} .*--reset-schedule"):
            resumed(stored, _options(14, **{name: value}), 10, reset=False)
    new, line = resumed(stored, _options(14, lr=0.5, warmup=0), 10, reset=True)
    assert new.phases == (stored.phases[0], Phase(10, 14, 0.5, 0, "cosine", 0.1))
    assert "a new schedule from step 11 to 14" in line
    assert "changed: lr 1.0 -> 0.5, warmup 2 -> 0" in line
    assert [new.lr_at(step) for step in (9, 10, 13, 20)] == pytest.approx([0.1, 0.5, 0.05, 0.05])


def test_a_checkpoint_without_a_schedule_has_the_one_of_its_options():
    theirs = vars(_options(10))
    assert stored_schedule({"options": theirs}, None) == LrSchedule.of(_options(10))


# -- real runs --------------------------------------------------------------------------
def _train(out: Path, *args: object):
    return invoke("train", "--out", out, "--device", "cpu", *args)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _lrs_and_losses(out: Path, steps: range) -> list[tuple[int, float, float]]:
    return [(m["step"], m["lr"], m["loss"]) for m in _metrics(out) if m["step"] in steps]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-step run: lr 3e-3 warmed up over 2 steps, cosine to 3e-4."""
    out = tmp_path_factory.mktemp("schedule") / "run"
    result = invoke(
        *("train", "--preset", "gpt2_tiny", "--steps", 6, "--batch", 2, "--seq-len", 16),
        *("--lr", "3e-3", "--warmup", 2, "--device", "cpu", "--out", out),
    )
    assert result.exit_code == 0, result.output
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_an_extended_run_goes_on_without_a_jump_and_resumes_alike(finished, tmp_path):
    out = _copy(finished, tmp_path / "run")
    result = _train(out, "--resume", "auto", "--steps", 10, "--checkpoint-every", 2)
    assert result.exit_code == 0, result.output
    assert (
        "resume: --steps 10 goes past the end of the run's schedule (step 6): the lr stays "
        "at 0.0003, where the schedule ends, without a jump"
    ) in result.output
    lrs = [m["lr"] for m in _metrics(out)]
    assert lrs[5] == pytest.approx(3e-4) and lrs[6:] == [lrs[5]] * 4
    extended = _lrs_and_losses(out, range(7, 11))
    manifest = json.loads((out / "step_000008" / "manifest.json").read_text())
    assert manifest["schedule"] == [
        {"start": 0, "end": 6, "lr": 3e-3, "warmup": 2, "schedule": "cosine", "min_lr_ratio": 0.1}
    ]
    # resumed from inside the extension (its --steps, 10, from the manifest): the same
    # steps again, lr and loss, as the uninterrupted extension
    again = _train(out, "--resume", out / "step_000008")
    assert again.exit_code == 0, again.output
    assert "goes past the end of the run's schedule (step 6)" in again.output
    assert _lrs_and_losses(out, range(7, 11)) == extended


def test_a_changed_schedule_is_refused_without_the_flag(finished):
    for args, option in (
        (("--lr", "1e-3"), "--lr 0.001 is not the resumed run's 0.003"),
        (("--warmup", 0, "--steps", 8), "--warmup 0 is not the resumed run's 2"),
        (("--schedule", "wsd"), "--schedule wsd is not the resumed run's cosine"),
    ):
        refused = _train(finished, "--resume", "auto", *args)
        assert_one_line_error(refused, 1, option, "pass --reset-schedule")
    alone = _train(finished, "--preset", "gpt2_tiny", "--steps", 8, "--reset-schedule")
    assert_one_line_error(alone, 2, "--reset-schedule", "--resume")


def test_a_manifest_whose_schedule_does_not_read_is_named(finished, tmp_path):
    out = _copy(finished, tmp_path / "run")
    manifest = out / "step_000006" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["schedule"] = [{"start": 0, "lr": "fast"}]
    manifest.write_text(json.dumps(data))
    refused = _train(out, "--resume", "auto", "--steps", 8)
    assert_one_line_error(refused, 1, str(manifest), "its schedule does not read")


def test_reset_schedule_starts_a_new_one_that_a_resume_repeats(finished, tmp_path):
    out = _copy(finished, tmp_path / "run")
    result = _train(
        out,
        *("--resume", "auto", "--reset-schedule", "--lr", "1e-3", "--warmup", 0),
        *("--steps", 9, "--checkpoint-every", 1),
    )
    assert result.exit_code == 0, result.output
    assert (
        "resume: --reset-schedule: a new schedule from step 7 to 9: lr 0.001, cosine to "
        "0.0001 at step 9 (the lr was 0.0003 at step 6; changed: lr 0.003 -> 0.001, "
        "warmup 2 -> 0)"
    ) in result.output
    lrs = [m["lr"] for m in _metrics(out)]
    assert lrs[6:] == pytest.approx([1e-3, 5.5e-4, 1e-4])
    reset = _lrs_and_losses(out, range(7, 10))
    # a resume without options takes the new lr from the manifest: no refusal, same steps
    again = _train(out, "--resume", out / "step_000007")
    assert again.exit_code == 0, again.output
    assert _lrs_and_losses(out, range(7, 10)) == reset
