"""Write the example programs of this folder (run from the repository root):

    python examples/programs/make.py

- ``training_step.json``: a bare training-shaped step (4 layers, 2 accumulation rounds;
  weights and optimizer state start in slow memory), from ``dataflow.testing.chains``.
"""

from __future__ import annotations

from pathlib import Path

from dataflow.testing import training_chain

HERE = Path(__file__).parent

if __name__ == "__main__":
    (HERE / "training_step.json").write_text(training_chain(layers=4, rounds=2).to_json() + "\n")
