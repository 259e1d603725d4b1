"""``dataflow-rl``: the loop from the command line, and bad input as one line naming the
option or file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dataflow_rl_example.cli import main

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
