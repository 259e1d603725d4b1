"""The ``dataflow`` pytest plugin, registered through the ``pytest11`` entry point.

Fixtures for tests of dataflow and of plugin packages:

- ``isolated_plugin_manager``: a factory ``isolated_plugin_manager(*plugins)`` returning a
  fresh plugin manager holding only the given plugin modules or objects (no entry point
  loads, the environment is ignored). While the test runs, the last one built is also the
  default manager, so code that calls ``dataflow.plugins.get_plugin_manager()`` sees it.
- ``fake_distribution``: a factory ``fake_distribution(name, entry_points=..., modules=...)``
  that writes an installed-looking distribution into a temporary folder on ``sys.path``.

Markers: ``gpu`` (needs CUDA: skipped where torch sees none) and ``slow``, registered for
every suite that has dataflow installed, plugin packages' suites included.

Kept light: importing it imports neither torch nor any plugin.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from dataflow import plugins
from dataflow.testing.distributions import write_distribution


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch  # only when some collected test is marked gpu

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` where CUDA is absent (CI never has a GPU)."""
    if not any(item.get_closest_marker("gpu") for item in items) or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def isolated_plugin_manager() -> Iterator[Callable[..., plugins.DataflowPluginManager]]:
    """Factory of fresh managers holding only the plugins passed; each becomes the default
    for the rest of the test, and the previous default comes back afterwards."""
    previous: list[plugins.DataflowPluginManager | None] = []

    def make(*plugin_objects: object) -> plugins.DataflowPluginManager:
        manager = plugins.isolated_plugin_manager(*plugin_objects)
        replaced = plugins.set_default_plugin_manager(manager)
        if not previous:
            previous.append(replaced)
        return manager

    yield make
    if previous:
        plugins.set_default_plugin_manager(previous[0])


@pytest.fixture
def fake_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Path]]:
    """Factory ``fake_distribution(name, *, entry_points, modules=None, version="1.0",
    group="dataflow") -> dist-info path``; the distributions vanish after the test."""
    site = tmp_path / "fake-site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    written: list[str] = []

    def make(
        name: str,
        *,
        entry_points: Mapping[str, str],
        modules: Mapping[str, str] | None = None,
        version: str = "1.0",
        group: str = "dataflow",
    ) -> Path:
        written.extend(modules or {})
        return write_distribution(
            site, name, entry_points=entry_points, modules=modules, version=version, group=group
        )

    yield make
    for module in written:
        sys.modules.pop(module, None)
    plugins.set_default_plugin_manager(None)  # a default built during the test saw the fakes
