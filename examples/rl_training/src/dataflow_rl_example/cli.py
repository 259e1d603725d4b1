"""``dataflow-rl``: the example's loop from the command line.

    dataflow-rl init --family llama3 --preset llama3_tiny --out policy
    dataflow-rl generate --model policy --out rollouts
    dataflow-rl update --family llama3 --model policy --rollouts rollouts --out policy
    dataflow-rl lower --family llama3 --model policy --rollouts rollouts -o update.json

``update`` keeps AdamW's moments beside the weights (``optimizer.safetensors``) and takes
them up again from ``--model``. Every failure is one line naming the option or file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from dataflow.cli import BUDGET, Failure, one_line

OPTIMIZER_FILE = "optimizer.safetensors"


def _family(name: str) -> Any:
    from dataflow_training import load_family

    from dataflow import UnknownNameError

    try:
        return load_family(name)
    except UnknownNameError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--family'") from None


def _checkpoint(family: Any, folder: Path) -> tuple[Any, dict[str, Any]]:
    from dataflow_training.kit import CheckpointError

    try:
        return family.import_hf(folder)
    except CheckpointError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--model'") from None


def _rollouts(folder: Path) -> Any:
    from dataflow_rl_example.rollouts import RolloutError, read_rollouts

    try:
        return read_rollouts(folder)
    except RolloutError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--rollouts'") from None


def _layers(text: str | None) -> tuple[int, ...] | None:
    if text is None or text == "all":
        return None
    if text == "none":
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: give block numbers like 0,2, or 'all' or 'none'",
            param_hint="'--hidden-layers'",
        ) from None


FOLDER = click.Path(file_okay=False, path_type=Path)
EXISTING = click.Path(exists=True, file_okay=False, path_type=Path)


@click.group()
def main() -> None:
    """An RL policy update from an inference engine's rollouts, planned by dataflow."""


@main.command()
@click.option("--family", required=True, help="a registered family (llama3, qwen3, qwen3_moe)")
@click.option("--preset", required=True, help="one of the family's presets")
@click.option("--out", type=FOLDER, required=True, help="the HF checkpoint folder to write")
@click.option("--seed", type=int, default=0, show_default=True)
def init(family: str, preset: str, out: Path, seed: int) -> None:
    """Write a randomly initialised model of a preset as an HF checkpoint folder."""
    import torch
    from dataflow_training.kit import UnknownPresetError

    found = _family(family)
    try:
        config = found.config(preset)
    except UnknownPresetError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--preset'") from None
    torch.manual_seed(seed)
    found.export_hf(config, found.reference_model(config).state_dict(), out)
    click.echo(f"wrote {out}")


@main.command()
@click.option("--model", type=EXISTING, required=True, help="the policy's HF checkpoint folder")
@click.option("--out", type=FOLDER, required=True, help="the rollout folder to write")
@click.option("--prompts", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--group-size", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--hidden-layers", help="blocks whose inputs to keep: 0,2 | all | none [all]")
@click.option("--reference", type=EXISTING, help="the frozen reference model (for the KL term)")
@click.option("--seed", type=int, default=0, show_default=True)
def generate(
    model, out, prompts, prompt_len, group_size, max_new_tokens, hidden_layers, reference, seed
):
    """Sample rollouts with the stand-in engine (transformers' generate) and write them.
    The prompts are random tokens; the reward is the toy ``low_token_reward``."""
    import torch

    from dataflow_rl_example.rollouts import write_rollouts
    from dataflow_rl_example.standin import generate_rollouts, load_model

    policy = load_model(model)
    vocab = policy.config.vocab_size
    chosen = torch.randint(
        0, vocab, (prompts, prompt_len), generator=torch.Generator().manual_seed(seed)
    )
    try:
        rollouts = generate_rollouts(
            policy,
            chosen,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            hidden_layers=_layers(hidden_layers),
            reference=load_model(reference) if reference else None,
            seed=seed,
        )
    except ValueError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--hidden-layers'") from None
    write_rollouts(rollouts, out)
    click.echo(f"wrote {rollouts.rows} rollouts of {rollouts.length} tokens to {out}")


def _options(
    loss: str, kl_coef: float, clip: float, weight_decay: float, dtype: str, rounds: int = 1
) -> Any:
    from dataflow_rl_example.program import UpdateOptions

    return UpdateOptions(
        loss=loss,
        clip_eps=clip,
        kl=kl_coef > 0,
        weight_decay=weight_decay,
        dtype=dtype,
        rounds=rounds,
    )


def _check_rounds(rounds: int, batch: Any, folder: Path) -> None:
    if batch.rows % rounds:
        raise click.BadParameter(
            f"{rounds} does not divide the {batch.rows} rows of {folder}",
            param_hint="'--rounds'",
        )


LOSS = click.option("--loss", type=click.Choice(["grpo", "ppo"]), default="grpo", show_default=True)
KL = click.option("--kl-coef", type=click.FloatRange(min=0), default=0.0, show_default=True)
CLIP = click.option("--clip", type=click.FloatRange(min=0), default=0.2, show_default=True)
DECAY = click.option("--weight-decay", type=click.FloatRange(min=0), default=0.0, show_default=True)
DTYPE = click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="parameters, gradients and activations (AdamW's moments stay float32)",
)
ROUNDS = click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="micro-batches of the rollouts' rows (each block's gradient accumulated over them)",
)


@main.command()
@click.option("--family", required=True, help="the model's family")
@click.option("--model", type=EXISTING, required=True, help="the policy's HF checkpoint folder")
@click.option("--rollouts", type=EXISTING, required=True, help="a rollout folder")
@click.option("--out", type=FOLDER, required=True, help="where to write the updated policy")
@click.option("--lr", type=click.FloatRange(min=0), default=1e-3, show_default=True)
@LOSS
@KL
@CLIP
@DECAY
@DTYPE
@ROUNDS
@click.option("--budget", type=BUDGET, help="fast-memory budget (default: keep everything)")
def update(
    family, model, rollouts, out, lr, loss, kl_coef, clip, weight_decay, dtype, rounds, budget
):
    """One policy update: plan it into the budget, run it, write the new weights."""
    from safetensors.torch import load_file, save_file

    from dataflow_rl_example.policy import BudgetError, PolicyTrainer

    found = _family(family)
    config, state = _checkpoint(found, model)
    batch = _rollouts(rollouts)
    if kl_coef and batch.ref_logprobs is None:
        raise click.BadParameter(
            f"{rollouts}: no ref_logprobs (generate them with --reference)",
            param_hint="'--kl-coef'",
        )
    _check_rounds(rounds, batch, rollouts)
    saved = model / OPTIMIZER_FILE
    trainer = PolicyTrainer(
        found,
        config,
        state,
        _options(loss, kl_coef, clip, weight_decay, dtype, rounds),
        budget_bytes=budget,
        optimizer_state=load_file(saved) if saved.is_file() else None,
    )
    try:
        stats = trainer.update(batch, lr=lr, kl_coef=kl_coef)
    except BudgetError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--budget'") from None
    except ValueError as error:
        raise Failure(one_line(str(error))) from None
    trainer.export(out)
    save_file(trainer.optimizer_state(), out / OPTIMIZER_FILE)
    click.echo(json.dumps({"update": trainer.updates, **stats}))


@main.command()
@click.option("--family", required=True, help="the model's family")
@click.option("--model", type=EXISTING, required=True, help="an HF checkpoint folder (its config)")
@click.option("--rollouts", type=EXISTING, required=True, help="a rollout folder (its shape)")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@LOSS
@KL
@CLIP
@DECAY
@DTYPE
@ROUNDS
def lower(family, model, rollouts, output, loss, kl_coef, clip, weight_decay, dtype, rounds):
    """Write the bare program of an update (for `dataflow plan --resolver rl-update`)."""
    from dataflow_training.kit import CheckpointError, read_config

    from dataflow_rl_example.program import lower_update

    found = _family(family)
    try:
        config = found.config_from_hf(read_config(model), str(model))
    except CheckpointError as error:
        raise click.BadParameter(one_line(str(error)), param_hint="'--model'") from None
    batch = _rollouts(rollouts)
    _check_rounds(rounds, batch, rollouts)
    step = lower_update(
        found,
        config,
        rows=batch.rows,
        length=batch.length,
        hidden_layers=batch.hidden_layers,
        options=_options(loss, kl_coef, clip, weight_decay, dtype, rounds),
    )
    output.write_text(step.program.to_json())
    click.echo(f"wrote {output}: {len(step.program.tasks)} tasks")
