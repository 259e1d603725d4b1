"""GPT-2 tiny trains on the engine exactly like its plain-autograd reference.

The whole stack: the gpt2 family, the training lowering, PressureFit, static placement,
the engine, the torch resolver and the torch kernels. Two accumulation rounds, three
steps, at a generous budget and at a tight one (a quarter above the smallest feasible),
compared with the reference model trained by torch.optim.AdamW in float64: every loss,
every first-step gradient, every final weight (fp32 tolerances of docs/correctness_compare.md).
"""

from __future__ import annotations

import pytest

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_resolver_torch")
pytest.importorskip("dataflow_kernels_torch")

from dataflow_training.check.verify import TOLERANCES, step_checks  # noqa: E402
from dataflow_training.step.config import TrainConfig  # noqa: E402
from dataflow_training.step.lowering import lower  # noqa: E402

from dataflow.planning import minimal_budget  # noqa: E402
from dataflow.plugins import families  # noqa: E402

SEQ, BATCH, ROUNDS, STEPS = 16, 2, 2, 3


@pytest.mark.parametrize("budget", ["generous", "tight"])
def test_gpt2_tiny_matches_reference(budget: str) -> None:
    family = families().get("gpt2").load()
    budget_bytes = None
    if budget == "tight":
        program = lower(
            family,
            "gpt2_tiny",
            TrainConfig(seq_len=SEQ, batch=BATCH, rounds=ROUNDS),
            keep_grads=True,
        ).program
        budget_bytes = int(1.25 * minimal_budget(program))
    checks = step_checks(
        family,
        "gpt2_tiny",
        device="cpu",
        policy="fp32",
        steps=STEPS,
        rounds=ROUNDS,
        batch=BATCH,
        seq_len=SEQ,
        budget_bytes=budget_bytes,
        seed=1,
        tolerance=TOLERANCES["fp32"]["step"],
    )
    failed = [check for check in checks if not check.ok]
    assert not failed, failed
    assert sum(check.name.startswith("loss") for check in checks) == STEPS * ROUNDS


def test_profiling_pass_prices_every_task_by_its_signature() -> None:
    from dataflow_training.plan.profile import apply_profile, profile_program, signature

    from dataflow.plugins import resolvers

    family = families().get("gpt2").load()
    step = lower(family, "gpt2_tiny", TrainConfig(seq_len=SEQ, batch=BATCH, rounds=2))
    program = step.program
    profiles = profile_program(step, resolvers().get("torch").build(step), device="cpu", repeats=1)
    # one measurement per distinct signature: the blocks of one kind share theirs
    assert len(profiles) < len(program.tasks)
    assert {signature(step, t) for t in program.tasks} == set(profiles)
    priced = apply_profile(step, profiles)
    assert all(task.cost_us > 0 for task in priced.tasks)
    assert all(task.workspace_bytes == 0 for task in priced.tasks)  # not measurable on CPU
    fwd = [t for t in priced.tasks if t.kind == "fwd"]
    assert len({t.cost_us for t in fwd}) == 1
