"""Start a training run from a Hugging Face model folder: ``dataflow train --init PATH``.

The folder is what ``save_pretrained`` writes and the hub serves: ``config.json`` beside
``model.safetensors``, or shards with ``model.safetensors.index.json`` (pickled weights
are refused). The family reads it (``import_hf``; ``config_from_hf`` for the config
alone, where it has one), so a Llama 3, Qwen 3, OLMoE, Qwen 3 MoE or GPT-2 checkpoint
starts a run of that family.

The run stays a preset plus overrides, as every run is: the checkpoint's config is
compared with the preset's, and the fields that differ become the run's overrides
(``hf_overrides``), so its checkpoints, ``--resume`` and ``dataflow export --hf`` work as
for any run. A checkpoint whose config is another preset's exactly is refused (the
preset given was most likely a slip); one that no preset matches trains as the named
preset with its fields, which the ``init:`` line lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from dataflow import families

#: fields an ``init:`` line names before it says how many more there are
SHOWN_FIELDS = 4


class InitError(ValueError):
    """An ``--init`` folder that cannot start the run; the message names the folder and
    the file or field at fault."""


@attrs.frozen
class HFStart:
    """What ``--init`` gives a run: the overrides that make the preset the checkpoint's
    config, and the line that says so."""

    path: Path
    config: Any
    overrides: dict[str, Any]
    line: str


def _jsonable(value: Any) -> Any:
    """An override as plain JSON values (a checkpoint's manifest keeps them)."""
    return attrs.asdict(value) if attrs.has(type(value)) else value


def hf_config(family: Any, family_name: str, path: str | Path) -> Any:
    """The config of the HF model folder ``path``, as ``family`` reads it (its
    ``config_from_hf`` when it has one, else its whole ``import_hf``)."""
    # kit.hf needs torch: `dataflow train` reads this module's options without it
    from dataflow_training.kit.hf import CONFIG, checkpoint_folder, read_config

    folder = Path(path)
    if not folder.exists():
        raise InitError(f"--init {path}: no such folder")
    try:
        if hasattr(family, "config_from_hf"):
            return family.config_from_hf(
                read_config(folder), str(checkpoint_folder(folder) / CONFIG)
            )
        if hasattr(family, "import_hf"):
            return family.import_hf(folder)[0]
    except ValueError as error:  # CheckpointError: names the file and the field
        raise InitError(f"--init: {error}") from None
    raise InitError(f"--init {path}: family {family_name!r} has no Hugging Face import (import_hf)")


def preset_of(path: str | Path, family_name: str | None = None) -> tuple[str, str]:
    """``(family, preset)`` for the HF model folder ``path`` when no preset is given: the
    installed family whose ``config_from_hf`` reads its ``config.json`` (``family_name``
    alone when given), and of its presets the one with that config exactly, else the one
    with the fewest fields apart (``hf_overrides`` then makes the rest the run's
    overrides). Families without ``config_from_hf`` are not tried: only their whole
    import reads a config."""

    if not Path(path).is_dir():
        raise InitError(f"--init {path}: no such folder")
    candidates: list[tuple[int, str, str]] = []
    refusals: list[str] = []
    for spec in families():
        if family_name is not None and spec.name != family_name:
            continue
        try:
            family = spec.load()
        except Exception:  # noqa: BLE001 - a broken family plugin cannot read it
            continue
        if not hasattr(family, "config_from_hf"):
            continue
        try:
            config = hf_config(family, spec.name, path)
        except InitError as error:
            refusals.append(str(error))
            continue
        for preset in getattr(family, "presets", {}):
            base = family.config(preset)
            if type(base) is type(config):
                candidates.append((len(_differing(config, base)), spec.name, preset))
    if not candidates:
        if family_name is not None:
            why = f" ({refusals[0].removeprefix('--init: ')})" if refusals else ""
            head = f"family {family_name!r} does not read its config.json{why}"
        elif refusals and all(r == refusals[0] for r in refusals):  # the folder's own fault
            head = refusals[0].removeprefix("--init: ").removeprefix(f"{path}: ")
        else:
            head = f"no installed family reads its config.json{_model_type(path)}"
        raise InitError(f"--init {path}: {head}; name the preset with --preset")
    _apart, family, preset = min(candidates)
    return family, preset


def _differing(config: Any, base: Any) -> list[str]:
    """The fields of ``config`` (an attrs config) whose values ``base``'s differ from."""
    names = [field.name for field in attrs.fields(type(config))]
    return [name for name in names if getattr(config, name) != getattr(base, name)]


def _model_type(path: str | Path) -> str:
    """`` (model_type 'x')`` of the folder's config.json where it says one, else ""."""
    # kit.hf needs torch: `dataflow train` reads this module's options without it
    from dataflow_training.kit.hf import read_config

    try:
        kind = read_config(Path(path)).get("model_type")
    except ValueError:
        return ""
    return f" (model_type {kind!r})" if kind else ""


def hf_overrides(family: Any, family_name: str, preset: str, path: str | Path) -> HFStart:
    """The run of ``preset`` that is the HF model at ``path``: its config's fields that
    differ from the preset's as overrides (all of them where the differing ones alone do
    not rebuild it, as a width whose ``head_dim`` the preset sets apart)."""
    config = hf_config(family, family_name, path)
    base = family.config(preset)
    if type(config) is not type(base):
        raise InitError(
            f"--init {path}: its config is a {type(config).__name__}; preset {preset!r} of "
            f"family {family_name!r} is a {type(base).__name__}"
        )
    names = [field.name for field in attrs.fields(type(config))]
    differing = _differing(config, base)
    if not differing:
        return HFStart(Path(path), config, {}, f"init: weights from {path} (preset {preset})")
    exact = [
        name
        for name in getattr(family, "presets", {})
        if name != preset and family.config(name) == config
    ]
    if exact:
        raise InitError(
            f"--init {path}: its config.json is preset {exact[0]!r}, not {preset!r} "
            f"({_fields(config, base, differing)}); pass --preset {exact[0]}"
        )
    overrides = {name: _jsonable(getattr(config, name)) for name in differing}
    if family.config(preset, **overrides) != config:
        overrides = {name: _jsonable(getattr(config, name)) for name in names}
    if family.config(preset, **overrides) != config:  # a config no override can reach
        raise InitError(
            f"--init {path}: preset {preset!r} with its config.json's fields is not its "
            f"config ({_fields(config, base, differing)})"
        )
    shown = ", ".join(f"{name}={getattr(config, name)!r}" for name in differing[:SHOWN_FIELDS])
    more = len(differing) - SHOWN_FIELDS
    shown += f" and {more} more" if more > 0 else ""
    line = (
        f"init: weights from {path}: preset {preset} with config.json's {shown} (no preset "
        f"of {family_name} has this config)"
    )
    return HFStart(Path(path), config, overrides, line)


def _fields(config: Any, base: Any, names: list[str]) -> str:
    """``hidden_size 2048 here, 4096 in the preset, ...`` for the first few ``names``."""
    said = [
        f"{name} {getattr(config, name)!r} there, {getattr(base, name)!r} in the preset"
        for name in names[:SHOWN_FIELDS]
    ]
    more = len(names) - SHOWN_FIELDS
    return "; ".join(said) + (f"; and {more} more field(s)" if more > 0 else "")


def hf_weights(family: Any, start: HFStart, dtype: Any) -> Mapping[str, Any]:
    """The model state of ``start``'s folder in ``dtype`` (keyed as the reference model's
    ``state_dict``): missing, mis-shaped or unexpected tensors are one error naming them."""
    try:
        config, state = family.import_hf(start.path, dtype=dtype)
    except ValueError as error:
        raise InitError(f"--init: {error}") from None
    if config != start.config:  # the folder changed since its config was read
        raise InitError(f"--init {start.path}: config.json changed while the run started")
    return state
