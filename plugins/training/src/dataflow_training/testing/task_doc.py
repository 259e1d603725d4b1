"""Each task of a lowered training step, its objects and their exact sizes, as Markdown:
the tables of ``docs/models/<family>.md``, generated from the lowering so they cannot drift.

``python -m dataflow_training.testing.task_doc FAMILY PRESET [--batch N] [--seq-len N]
[--dtype fp32|bf16]`` prints one step's tables. A page holds them between
``<!-- task_doc FAMILY PRESET ARGS -->`` and ``<!-- /task_doc -->``; ``stale_blocks(page)``
regenerates every such block and returns those that differ (a family's test asserts there
are none), and ``--write PAGE`` rewrites them in place.

One row per distinct task (the first of each kind for each layer kind: the first block of
each block kind stands for every block of it, step 0 round 0 for every round), then every object those tasks name, with
its bytes and what it holds (the named tensors of a packed object, or its dtype and shape).
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

BLOCK = re.compile(r"<!-- task_doc (?P<args>[^>]*) -->\n(?P<body>.*?)<!-- /task_doc -->", re.S)


def _size(size_bytes: int) -> str:
    mib = size_bytes / 2**20
    return f"{size_bytes:,}" + (f" ({mib:,.1f} MiB)" if mib >= 0.1 else "")


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape)) or "scalar"


def _holds(packed: Any) -> str:
    """A packed object's tensors; a gradient or optimizer state by the weights it is of."""
    entries = packed.layout.entries
    dtypes = ", ".join(sorted({e.dtype for e in entries}))
    weights = "W" + packed.id.removeprefix(packed.kind)
    if packed.kind == "dW":
        return f"a gradient of each tensor of `{weights}`, {dtypes}"
    if packed.kind == "O":
        fields = dict.fromkeys(e.name.rpartition("/")[2] for e in entries)
        return f"{', '.join(f'`{f}`' for f in fields)} of each tensor of `{weights}`, {dtypes}"
    return "<br>".join(f"`{e.name}` {_shape(e.shape)} {e.dtype}" for e in entries)


def task_doc(family_name: str, preset: str, *, batch: int, seq_len: int, dtype: str) -> str:
    """The Markdown tables of one training step of ``family_name``'s ``preset``."""
    family = load_family(family_name)
    train = TrainConfig(seq_len=seq_len, batch=batch, dtype=DtypePolicy.named(dtype))
    lowered = lower(family, preset, train)
    program, layout = lowered.program, lowered.layout
    kinds = {layer.name: layer.kind for layer in layout.layers}
    objects = {obj.id: obj for obj in program.objects}
    firsts = {}  # the first layer of each layer kind stands for every layer of it
    for layer in layout.layers:
        firsts.setdefault(layer.kind, layer.name)
    shown: dict[tuple[str, str], Any] = {}
    for task in program.tasks:
        slot = layout.tasks[task.id]
        if slot.round_ == 0 and slot.layer in firsts.values():
            shown.setdefault((slot.kind, kinds[slot.layer]), task)
    policy = train.dtype
    lines = [
        f"`{preset}`, one step of batch {batch} x {seq_len:,} tokens: weights {policy.param}, "
        f"gradients {policy.grad}, activations {policy.activation}, AdamW states "
        f"{', '.join(sorted(set(train.optimizer.state_dtypes.values())))}; "
        f"{len(program.tasks):,} tasks over {len(program.objects):,} objects.",
        "",
        "| task | compute key | reads | changes | creates |",
        "|---|---|---|---|---|",
    ]
    named: dict[str, None] = {}
    for task in shown.values():
        cells = []
        for ids in (task.inputs, task.mutates, task.outputs):
            named.update(dict.fromkeys(ids))
            cells.append(", ".join(f"`{i}`" for i in ids) or "-")
        lines.append(f"| `{task.id}` | `{task.compute_key}` | {' | '.join(cells)} |")
    lines += ["", "| object | role | bytes | holds |", "|---|---|--:|---|"]
    for obj_id in named:
        obj = objects[obj_id]
        packed = layout.packed.get(obj_id)
        if packed is not None:
            holds = _holds(packed)
        elif obj.tensor is not None:
            holds = f"{obj.tensor.dtype} {_shape(obj.tensor.shape)}"
        else:
            holds = "-"
        lines.append(f"| `{obj_id}` | {obj.role.value} | {_size(obj.size_bytes)} | {holds} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dataflow_training.testing.task_doc")
    parser.add_argument("family")
    parser.add_argument("preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    return parser


def _generate(args: str) -> str:
    parsed = _parser().parse_args(shlex.split(args))
    return task_doc(
        parsed.family,
        parsed.preset,
        batch=parsed.batch,
        seq_len=parsed.seq_len,
        dtype=parsed.dtype,
    )


def stale_blocks(page: str) -> list[str]:
    """The arguments of every generated block of ``page`` (a page's text) whose tables
    are not what the lowering gives now."""
    return [m["args"] for m in BLOCK.finditer(page) if m["body"] != _generate(m["args"])]


def rewrite(page: str) -> str:
    """``page`` with every generated block regenerated."""
    return BLOCK.sub(
        lambda m: f"<!-- task_doc {m['args']} -->\n{_generate(m['args'])}<!-- /task_doc -->", page
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dataflow_training.testing.task_doc")
    parser.add_argument("--write", metavar="PAGE", help="regenerate PAGE's blocks in place")
    known, rest = parser.parse_known_args(argv)
    if known.write:
        path = Path(known.write)
        path.write_text(rewrite(path.read_text()))
        return
    print(_generate(shlex.join(rest)), end="")


if __name__ == "__main__":
    main()
