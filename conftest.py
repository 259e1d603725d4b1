"""Repository-wide pytest hook: the suites run in one pytest process (``nox -s tests``).

With ``--import-mode=importlib`` pytest names a test module by its path from the
repository root (``kernels/torch/tests/test_adamw.py`` is
``kernels.torch.tests.test_adamw``) and imports the missing parents (``kernels``,
``kernels.torch``, ...) as namespace packages of the repository's folders. One named like
an installed package hides it: transformers imports the Hugging Face ``kernels``
package, and found the namespace module of this repository's ``kernels/`` folder instead
("cannot import name 'CUDAProperties' from 'kernels' (unknown location)"), failing every
test that builds a transformers model after the kernel tests were collected. Once
collection is over the test modules are imported, so the namespace modules of the
repository's top-level folders are dropped: an import of that name then finds the real
package, if there is one.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent

try:  # every session installs hypothesis with pytest; a bare checkout may not have it
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:
    # Hypothesis's timing checks measure the machine, not the code: on CI's two shared
    # cores a first draw once took 3.4 s (FailedHealthCheck "input generation is slow"
    # of a list of small integers, session 40). Tests that set their own settings keep
    # them; the rest run without a deadline or the too-slow check.
    settings.register_profile(
        "dataflow", deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("dataflow")


def pytest_collection_finish(session) -> None:
    for folder in ROOT.iterdir():
        module = sys.modules.get(folder.name)
        if module is None or getattr(module, "__file__", None) is not None:
            continue  # not imported, or a real module
        paths = [Path(path).resolve() for path in getattr(module, "__path__", ())]
        if all(path == folder for path in paths):
            del sys.modules[folder.name]
