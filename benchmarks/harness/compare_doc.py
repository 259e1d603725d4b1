"""The results document of benchmarks/compare.py: its rows, how runs merge, the ratio to
the fastest stock row, and the Markdown table of docs/throughput.md.

``{"rows": [...], "meta": {...}}``. A row has exactly the fields of issue 13 plus ``model``
(the preset it trains) and ``note`` (why a row is missing or what went wrong on the way);
every row carries the ``seq_len`` it trained at and its ``mode`` (``full``: pretraining's
step; ``lora``: adapters on a frozen base; ``rl``: a policy update from rollouts); rows are
keyed by ``model|engine|dtype|budget_bytes|seq_len|mode``, so the runs of several models,
sequence lengths and modes merge into one file; ``meta.models`` keeps per model its family, sequence length, FLOPs per
token and the run that last measured it; ``meta.row_details`` keeps, per row key, what the
table's "limited by" column and a reader need beyond the row: the link's busy share, the
batch search, the rounds. Each row's ``ratio_to_fastest_stock`` is against the fastest
stock row of the same model, sequence length and mode. A file written before rows had
``model`` is read as the GPT-2 run it was (``LEGACY_MODEL``); one written before rows had
``seq_len`` and ``mode`` gets its model's sequence length (``meta.models``) and ``full``.

**Limited by** (derived from the measurements): ``compute`` when compute idle is at most
``IDLE_COMPUTE_PCT`` of the step. Otherwise, for a step replayed from a CUDA graph, ``host``
when the host time between replays (wall step less replay) is at least half the idle time, else
``link`` (the compute stream waited on transfers inside the replay); for any other step, ``link``
when the busier copy direction moved bytes for at least ``LINK_BUSY_PCT`` of the step, else
``host`` (the device waited on something that is not the link: dispatch, a host-side
optimizer, synchronisation).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.harness.measure import BatchSearch, idle_pct, link_busy_pct
from dataflow.units import format_size

FIELDS = (
    "model",
    "engine",
    "dtype",
    "budget_bytes",
    "seq_len",
    "mode",
    "batch",
    "tokens_per_step",
    "tok_s",
    "mfu",
    "allocator_peak_bytes",
    "moved_bytes_per_step",
    "compute_idle_pct",
    "predicted_step_s",
    "measured_step_s",
    "ratio_to_fastest_stock",
    "note",
)
IDLE_COMPUTE_PCT = 5.0
LINK_BUSY_PCT = 80.0
TABLE_START, TABLE_END = "<!-- compare.py table: start -->", "<!-- compare.py table: end -->"
#: the preset of rows written before rows had ``model`` (the GPT-2 comparison of issue 13)
LEGACY_MODEL = "gpt2_124m"
#: the meta fields that describe one model (``meta.models[preset]``)
MODEL_META = (
    "family",
    "preset",
    "seq_len",
    "flops_per_token",
    "dataflow_matches",
    "peak_flops",
    "peak_source",
)
RUN_META = ("date", "device", "torch")
#: what a row's step trains (``mode``): pretraining's full step, LoRA adapters on a frozen
#: base, an RL policy update from rollouts
MODES = ("full", "lora", "rl")
ENGINE_ORDER = ("pytorch eager", "pytorch compile", "pytorch", "deepspeed", "dataflow")


def row_key(row: dict[str, Any]) -> str:
    return (
        f"{row['model']}|{row['engine']}|{row['dtype']}|{row['budget_bytes']}"
        f"|{row['seq_len']}|{row['mode']}"
    )


def group_of(row: dict[str, Any]) -> tuple[str, int | None, str]:
    """The rows a row is rated against: same model, sequence length and mode."""
    return (row["model"], row["seq_len"], row["mode"])


def make_row(
    model: str,
    engine: str,
    dtype: str,
    budget_bytes: int | None,
    *,
    seq_len: int | None = None,
    mode: str = "full",
    batch: int | None = None,
    tokens_per_step: int | None = None,
    measured_step_s: float | None = None,
    allocator_peak_bytes: int | None = None,
    moved_bytes_per_step: int | None = None,
    compute_idle_pct: float | None = None,
    predicted_step_s: float | None = None,
    note: str | None = None,
    flops_token: float | None = None,
    peak: float | None = None,
) -> dict[str, Any]:
    """A row with exactly the issue's fields plus ``note``: tok/s from the measured step,
    MFU from tok/s x model FLOPs per token / the device's peak (None when either is
    unknown). ``ratio_to_fastest_stock`` is filled by ``finish``."""
    if mode not in MODES:
        raise ValueError(f"a row's mode is one of {', '.join(MODES)}, not {mode!r}")
    tok_s = tokens_per_step / measured_step_s if tokens_per_step and measured_step_s else None
    mfu = tok_s * flops_token / peak if tok_s and flops_token and peak else None
    return {
        "model": model,
        "engine": engine,
        "dtype": dtype,
        "budget_bytes": budget_bytes,
        "seq_len": seq_len,
        "mode": mode,
        "batch": batch,
        "tokens_per_step": tokens_per_step,
        "tok_s": tok_s,
        "mfu": mfu,
        "allocator_peak_bytes": allocator_peak_bytes,
        "moved_bytes_per_step": moved_bytes_per_step,
        "compute_idle_pct": compute_idle_pct,
        "predicted_step_s": predicted_step_s,
        "measured_step_s": measured_step_s,
        "ratio_to_fastest_stock": None,
        "note": note,
    }


def searched_row(
    model: str,
    engine: str,
    dtype: str,
    search: BatchSearch,
    seq_len: int,
    note: str | None,
    **flops: float | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The row of a budget-free engine (stock, DeepSpeed) at the best batch of its search,
    and its details; a row with a note when no batch ran. ``flops``: ``flops_token`` and
    ``peak`` for MFU."""
    details: dict[str, Any] = {"batch_search_tok_s": search.tried}
    best = search.best
    if best is None:
        failures = "; ".join(f"batch {b}: {v}" for b, v in search.tried.items())
        note = note or f"no batch ran ({failures})"
        return make_row(model, engine, dtype, None, seq_len=seq_len, note=note), details
    activity, step_s = best["activity"], best["step_s"]
    if activity is not None:
        details |= {"kernel_s": activity.kernel_s, "link_busy_pct": link_busy_pct(activity, step_s)}
    row = make_row(
        model,
        engine,
        dtype,
        None,
        seq_len=seq_len,
        batch=best["batch"],
        tokens_per_step=best["batch"] * seq_len,
        measured_step_s=step_s,
        allocator_peak_bytes=best["peak"],
        moved_bytes_per_step=None if activity is None else activity.moved_bytes,
        compute_idle_pct=None if activity is None else idle_pct(activity.kernel_s, step_s),
        note=note,
        **flops,
    )
    return row, details


def fastest_by_group(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Each group's (``group_of``) fastest stock (budget-free) row's tokens/s."""
    fastest: dict[tuple, float] = {}
    for row in rows:
        if row["budget_bytes"] is None and row["tok_s"]:
            group = group_of(row)
            fastest[group] = max(fastest.get(group, 0.0), row["tok_s"])
    return fastest


def fastest_stock(rows: list[dict[str, Any]], mode: str = "full") -> dict[str, float]:
    """Each model's fastest stock (budget-free) row's tokens/s among its rows of ``mode``."""
    fastest: dict[str, float] = {}
    for (model, _, of_mode), tok_s in fastest_by_group(rows).items():
        if of_mode == mode:
            fastest[model] = max(fastest.get(model, 0.0), tok_s)
    return fastest


def finish(doc: dict[str, Any]) -> dict[str, Any]:
    """Sort the rows (by model, then mode, sequence length and engine) and set every row's
    ratio to the fastest stock (budget-free) row of its group (``group_of``)."""
    rows = doc["rows"]
    fastest = fastest_by_group(rows)
    for row in rows:
        best = fastest.get(group_of(row))
        row["ratio_to_fastest_stock"] = row["tok_s"] / best if best and row["tok_s"] else None
    models = list(doc["meta"].get("models", {}))

    def order(row: dict[str, Any]) -> tuple:
        model = models.index(row["model"]) if row["model"] in models else len(models)
        family = next((i for i, e in enumerate(ENGINE_ORDER) if row["engine"].startswith(e)), 9)
        return (
            model,
            row["model"],
            MODES.index(row["mode"]),
            row["seq_len"] or 0,
            family,
            row["engine"],
            row["dtype"],
            -(row["budget_bytes"] or 0),
        )

    rows.sort(key=order)
    return doc


def load_doc(path: Path) -> dict[str, Any]:
    """The document at ``path``, or an empty one when there is none yet (a file from
    before rows had ``model`` is brought up to date: ``upgrade``)."""
    if not path.exists():
        return {"rows": [], "meta": {"models": {}}}
    doc = json.loads(path.read_text())
    if not isinstance(doc.get("rows"), list) or not isinstance(doc.get("meta"), dict):
        raise ValueError(f"{path}: not a compare.py result (needs 'rows' and 'meta')")
    upgrade(doc)
    for row in doc["rows"]:
        if tuple(row) != FIELDS:
            raise ValueError(f"{path}: row {row_key(row)} has fields {sorted(row)}")
    return doc


def upgrade(doc: dict[str, Any]) -> None:
    """Rows without ``model`` are the GPT-2 run of ``meta.preset`` (``LEGACY_MODEL``): give
    them the field, key their details by model too, and move the model's meta fields
    under ``meta.models``; rows without ``seq_len`` and ``mode`` get them."""
    meta = doc["meta"]
    meta.setdefault("models", {})
    legacy = [row for row in doc["rows"] if "model" not in row]
    if legacy or any(field in meta for field in MODEL_META):
        _upgrade_models(doc)
    _upgrade_modes(doc)


def _upgrade_modes(doc: dict[str, Any]) -> None:
    """Rows without ``seq_len`` and ``mode``: their model's sequence length and ``full``,
    their details keyed anew."""
    models, details = doc["meta"]["models"], doc["meta"].get("row_details", {})
    for i, row in enumerate(doc["rows"]):
        if "mode" in row:
            continue
        old_key = f"{row['model']}|{row['engine']}|{row['dtype']}|{row['budget_bytes']}"
        seq_len = models.get(row["model"], {}).get("seq_len")
        new = {k: row[k] for k in ("model", "engine", "dtype", "budget_bytes")}
        new |= {"seq_len": seq_len, "mode": "full"}
        doc["rows"][i] = row = new | {k: v for k, v in row.items() if k not in new}
        if old_key in details:
            details[row_key(row)] = details.pop(old_key)


def _upgrade_models(doc: dict[str, Any]) -> None:
    """Rows without ``model``: the GPT-2 run of ``meta.preset`` (``upgrade``)."""
    meta = doc["meta"]
    models = meta["models"]
    model = meta.get("preset", LEGACY_MODEL)
    entry = models.setdefault(model, {})
    for field in MODEL_META:
        if field in meta:
            entry[field] = meta[field]
    for field in MODEL_META:
        meta.pop(field, None)
    for field in RUN_META:
        entry.setdefault(field, meta.get(field))
    details = meta.get("row_details", {})
    for i, row in enumerate(doc["rows"]):
        if "model" in row:
            continue
        old_key = f"{row['engine']}|{row['dtype']}|{row['budget_bytes']}"
        doc["rows"][i] = row = {"model": model} | row
        if old_key in details:
            details[f"{model}|{old_key}"] = details.pop(old_key)


def save_doc(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(doc, indent=1) + "\n")
    temporary.replace(path)


def limited_by(row: dict[str, Any], details: dict[str, Any]) -> str:
    """``compute``, ``link`` or ``host`` from the row's measurements (module docstring)."""
    idle = row["compute_idle_pct"]
    if row["tok_s"] is None or idle is None:
        return ""
    if idle <= IDLE_COMPUTE_PCT:
        return "compute"
    replay_s, wall_s = details.get("engine_makespan_s"), row.get("measured_step_s")
    if replay_s is not None and wall_s:
        # A replayed step: host time is what lies outside the replay; the rest of the
        # idle time is the compute stream waiting for transfers inside it.
        host_pct = 100.0 * (wall_s - replay_s) / wall_s
        return "host" if host_pct >= idle / 2 else "link"
    return "link" if details.get("link_busy_pct", 0.0) >= LINK_BUSY_PCT else "host"


def _size(value: int | None) -> str:
    return "" if value is None else format_size(value)


def _number(value: float | None, digits: int, scale: float = 1.0) -> str:
    return "" if value is None else f"{value * scale:,.{digits}f}"


def _mfu(mfu: float | None, causal: float | None) -> str:
    """The MFU cell: the PaLM convention's, then with attention counted causally where the
    row's details have it (``compare.Bench.causal_mfu``)."""
    if mfu is None:
        return ""
    return f"{100 * mfu:.1f} %" + ("" if causal is None else f" ({100 * causal:.1f} % causal)")


def render_tables(doc: dict[str, Any]) -> str:
    """One table per model, each under a heading naming it (the order of ``finish``)."""
    models = list(dict.fromkeys(row["model"] for row in doc["rows"]))
    parts = [f"### {model}\n\n" + render_table(doc, model) for model in models]
    return "\n".join(parts)


def render_table(doc: dict[str, Any], model: str) -> str:
    """The Markdown table of ``model``'s rows (the order of ``finish``)."""
    details = doc["meta"].get("row_details", {})
    head = (
        "| engine | mode | seq | dtype | budget | batch | tokens/step | tok/s | MFU | vs fastest stock "
        "| allocator peak | moved/step | compute idle | predicted s/step | measured s/step "
        "| measured/predicted | limited by | note |"
    )
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for row in doc["rows"]:
        if row["model"] != model:
            continue
        extra = details.get(row_key(row), {})
        rounds = extra.get("rounds")
        batch = "" if row["batch"] is None else str(row["batch"])
        if rounds and rounds > 1:
            batch += f" x {rounds} rounds"
        ratio = None
        if row["predicted_step_s"] and row["measured_step_s"]:
            ratio = row["measured_step_s"] / row["predicted_step_s"]
        cells = [
            row["engine"],
            row["mode"],
            _number(row["seq_len"], 0),
            row["dtype"],
            "none" if row["budget_bytes"] is None else _size(row["budget_bytes"]),
            batch,
            _number(row["tokens_per_step"], 0),
            _number(row["tok_s"], 0),
            _mfu(row["mfu"], extra.get("mfu_causal")),
            _number(row["ratio_to_fastest_stock"], 2),
            _size(row["allocator_peak_bytes"]),
            _size(row["moved_bytes_per_step"]),
            "" if row["compute_idle_pct"] is None else f"{row['compute_idle_pct']:.1f} %",
            _number(row["predicted_step_s"], 4),
            _number(row["measured_step_s"], 4),
            _number(ratio, 3),
            limited_by(row, extra),
            (row["note"] or "").replace("|", "/").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    meta = doc["meta"].get("models", {}).get(model, {})
    peak = meta.get("peak_flops")
    against = (
        f"MFU against {peak / 1e12:.0f} TFLOP/s ({meta.get('peak_source')})"
        if peak
        else "no MFU: no peak known for this device"
    )
    lines.append("")
    lines.append(
        f"{_runs(doc, model)}; {model}; {against}; each row rated against the fastest stock "
        "row of its mode and sequence length."
    )
    return "\n".join(lines) + "\n"


def _runs(doc: dict[str, Any], model: str) -> str:
    """The runs that measured ``model``'s rows: its entry's (device, torch, date), or where a
    script recorded a row's own run (``row_details[key]["run"]``: the RL rows of
    ``rl_update.py``), each run with the modes of its rows."""
    meta = doc["meta"].get("models", {}).get(model, {})
    details = doc["meta"].get("row_details", {})
    runs: dict[str, list[str]] = {}
    for row in doc["rows"]:
        if row["model"] == model:
            run = details.get(row_key(row), {}).get("run", meta)
            said = (
                f"{run.get('device', '?')}, torch {run.get('torch', '?')}, {run.get('date', '?')}"
            )
            runs.setdefault(said, []).append(row["mode"])
    if len(runs) <= 1:
        return next(iter(runs), "?, torch ?, ?")
    return "; ".join(
        f"{said} ({', '.join(dict.fromkeys(modes))} rows)" for said, modes in runs.items()
    )


def write_table(doc: dict[str, Any], page: Path) -> None:
    """Put the table between the page's two marker lines (the prose around stays)."""
    text = page.read_text()
    pattern = re.compile(re.escape(TABLE_START) + r"\n.*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(
            f"{page}: no '{TABLE_START}' ... '{TABLE_END}' lines to put the table between"
        )
    table = render_tables(doc)
    page.write_text(pattern.sub(lambda _: f"{TABLE_START}\n{table}{TABLE_END}", text))
