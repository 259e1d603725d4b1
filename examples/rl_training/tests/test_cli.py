"""``dataflow-rl``: the loop from the command line, and bad input as one line naming the
option or file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dataflow_rl_example.cli import main
from safetensors.torch import load_file

pytest.importorskip("transformers")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_init_generate_update_twice(tmp_path):
    assert (
        run(
            "init", "--family", "llama3", "--preset", "llama3_tiny", "--out", tmp_path / "p0"
        ).exit_code
        == 0
    )
    for update in range(2):
        policy, rollouts = tmp_path / f"p{update}", tmp_path / f"r{update}"
        assert (
            run("generate", "--model", policy, "--out", rollouts, "--hidden-layers", "0").exit_code
            == 0
        )
        result = run(
            "update", "--family", "llama3", "--model", policy, "--rollouts", rollouts,
            "--out", tmp_path / f"p{update + 1}", "--budget", "2MiB",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        stats = json.loads(result.output)
        assert stats["update"] == update + 1  # AdamW's count carried in optimizer.safetensors
    assert (tmp_path / "p2" / "optimizer.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["init", "--family", "nope", "--preset", "x", "--out", "o"], "'--family'"),
        (["init", "--family", "llama3", "--preset", "nope", "--out", "o"], "'--preset'"),
        (["generate", "--model", "{model}", "--out", "o", "--hidden-layers", "a,b"], "'--hidden-layers'"),
        (["generate", "--model", "{model}", "--out", "o", "--hidden-layers", "7"], "'--hidden-layers'"),
        (["update", "--family", "llama3", "--model", "{model}", "--rollouts", "{model}", "--out", "o"], "'--rollouts'"),
        (["update", "--family", "llama3", "--model", "{rollouts}", "--rollouts", "{rollouts}", "--out", "o"], "'--model'"),
        (["update", "--family", "llama3", "--model", "{model}", "--rollouts", "{rollouts}", "--out", "o", "--budget", "1KiB"], "'--budget'"),
        (["update", "--family", "llama3", "--model", "{model}", "--rollouts", "{rollouts}", "--out", "o", "--kl-coef", "0.1"], "ref_logprobs"),
        (["update", "--family", "llama3", "--model", "{model}", "--rollouts", "{rollouts}", "--out", "o", "--rounds", "3"], "'--rounds'"),
        (["update", "--family", "llama3", "--model", "{model}", "--rollouts", "{rollouts}", "--out", "o", "--rounds", "0"], "'--rounds'"),
        (["lower", "--family", "llama3", "--model", "{model}", "--rollouts", "{rollouts}", "-o", "u.json", "--rounds", "3"], "'--rounds'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_culprit(tmp_path, args, culprit):
    model, rollouts = tmp_path / "model", tmp_path / "rollouts"
    run("init", "--family", "llama3", "--preset", "llama3_tiny", "--out", model)
    run("generate", "--model", model, "--out", rollouts, "--hidden-layers", "0")
    result = run(*(a.format(model=model, rollouts=rollouts) for a in args))
    assert result.exit_code in (1, 2), result.output
    assert (
        "Traceback" not in result.output
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    )
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and culprit in lines[0], result.output


def test_update_in_rounds_is_the_update_in_one(tmp_path):
    """``--rounds 4``: the update of the rollouts' 8 rows in micro-batches of 2 writes the
    weights and stats of the update in one (to fp32 rounding)."""
    model, rollouts = tmp_path / "model", tmp_path / "rollouts"
    run("init", "--family", "llama3", "--preset", "llama3_tiny", "--out", model)
    run("generate", "--model", model, "--out", rollouts)
    stats = {}
    for rounds in (1, 4):
        result = run(
            "update", "--family", "llama3", "--model", model, "--rollouts", rollouts,
            "--out", tmp_path / f"r{rounds}", "--rounds", rounds, "--budget", "2MiB",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        stats[rounds] = json.loads(result.output)
    assert stats[4] == pytest.approx(stats[1], abs=1e-6)
    ours = load_file(tmp_path / "r4" / "model.safetensors")
    one = load_file(tmp_path / "r1" / "model.safetensors")
    assert max((ours[k] - one[k]).abs().max().item() for k in one) < 2e-5
    lowered = run(
        "lower", "--family", "llama3", "--model", model, "--rollouts", rollouts,
        "-o", tmp_path / "update.json", "--rounds", 4,
    )  # fmt: skip
    assert lowered.exit_code == 0 and "head_r3" in (tmp_path / "update.json").read_text()
