"""An RL policy update (GRPO, PPO) planned and run by dataflow, from the hidden states an
inference engine saved while it sampled: no forward pass is run again.

Light: the names import torch only when first used (the entry point imports this package).
"""

from dataflow import exported, lazy_exports

_HOMES = {
    "dataflow_rl_example.rollouts": (
        "Rollouts",
        "RolloutError",
        "read_rollouts",
        "write_rollouts",
    ),
    "dataflow_rl_example.program": ("UpdateOptions", "UpdateStep", "lower_update"),
    "dataflow_rl_example.loss": ("advantages", "LOSSES"),
    "dataflow_rl_example.policy": ("PolicyTrainer",),
    "dataflow_rl_example.standin": ("generate_rollouts", "low_token_reward"),
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
__all__ = exported(_HOMES)
