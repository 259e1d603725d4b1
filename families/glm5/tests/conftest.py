"""The deepseek family's HF parity tests, which glm5's extend, on the import path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deepseek" / "tests"))
