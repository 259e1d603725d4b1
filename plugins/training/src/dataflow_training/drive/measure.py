"""``measure``: the cells of a ``predict`` grid run on the engine, beside their prediction.

Each cell is planned once (``compile_step``: priced by the profiling pass through its
disk cache and by links measured on the device, CPU or CUDA), then run for ``steps``
optimizer steps on random tokens; the first ``warmup`` are dropped and the median of the
rest is the measured step, printed beside the plan's simulated step with their ratio
(measured / predicted). A cell that cannot be planned or does not fit the device is a
row that says why. ``on_event`` hears, as one line each, when a cell is planned and when
each of its steps ends (a large model's cell takes minutes: the CLI prints them).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from dataflow import BudgetBreachError, PlanningError
from dataflow_training.plan.compiled_step import compile_step
from dataflow_training.plan.hardware import HardwareEntry
from dataflow_training.plan.predict import (
    Cell,
    _one_line,
    cell_overrides,
    each_cell,
    infeasible_row,
    row_of,
    train_config,
    vocab_size,
)
from dataflow_training.step.precision import pinned


def measure_cell(
    family: Any,
    cell: Cell,
    hw: HardwareEntry,
    *,
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    recompute: bool = True,
    dtype: str = "bf16",
    states: str = "fp32",
    precision: str | None = None,
    resolver: str = "torch",
    seed: int = 0,
    on_event: Callable[[Cell, str], None] | None = None,
) -> dict[str, Any]:
    """One cell's row: the predicted row's fields and ``predicted_step_s``,
    ``measured_step_s``, ``ratio``, ``steps_s`` (every step's wall time), ``losses``
    (every step's mean loss, so a run that went wrong shows) and the allocator's peak
    (CUDA)."""
    # torch loads when a cell is measured: `dataflow measure` reads this module without it
    import torch

    # torch loads when a cell is measured: `dataflow measure` reads this module without it
    from dataflow_training.drive.run import TrainingRun

    extra: dict[str, Any] = {"hw": hw.name, "costs": "measured", "device": device}
    extra["resolver"] = resolver
    extra["optimizer_states"] = states
    extra["precision"] = precision or pinned(dtype, states).name
    reason = cell.why_not()
    if reason is not None:
        return infeasible_row(cell, extra, reason)
    overrides = cell_overrides(family, cell)
    extra["overrides"] = overrides
    vocab = cell.vocab_size or vocab_size(family, cell.preset)
    train = train_config(cell, dtype, vocab=vocab, states=states, precision=precision)
    run = None
    try:
        compiled = compile_step(
            family,
            cell.preset,
            train,
            overrides=overrides,
            budget_bytes=cell.budget_bytes,
            backing_bytes=cell.backing_bytes,
            device=device,
            resolver=resolver,
            recompute=recompute,
        )
        run = TrainingRun(compiled, seed=seed)
        row = row_of(compiled.plan, compiled.running, cell, extra)
        if cell.backing_bytes is not None and row["backing_peak_bytes"] > cell.backing_bytes:
            return infeasible_row(
                cell,
                extra,
                f"the plan needs {row['backing_peak_bytes']} bytes of backing memory, more "
                f"than --backing ({cell.backing_bytes} bytes)",
            )

        def tell(line: str) -> None:
            if on_event is not None:
                on_event(cell, line)

        tell(
            f"planned: {row['step_s']:.4f} s a step predicted, "
            f"{row['rounds']} rounds of batch {row['batch']}"
        )
        generator = torch.Generator().manual_seed(seed)
        vocab = run.vocab_size
        times, peaks, losses = [], [], []
        for _ in range(steps):
            batches = [
                (
                    torch.randint(0, vocab, (train.batch, train.seq_len), generator=generator),
                    torch.randint(0, vocab, (train.batch, train.seq_len), generator=generator),
                )
                for _ in range(train.rounds)
            ]
            stats = run.step(batches)
            times.append(stats.step_s)
            peaks.append(stats.allocator_peak_bytes)
            losses.append(stats.loss)
            tell(f"step {len(times)}/{steps}: {stats.step_s:.4f} s, loss {stats.loss:.4f}")
    except (PlanningError, ValueError) as exc:
        return infeasible_row(cell, extra, _one_line(str(exc)))
    except BudgetBreachError as exc:
        # The engine refuses a step whose allocator peak left the budget: the cell did not
        # run inside it, which is a result to report, not a crash of the grid.
        return infeasible_row(cell, extra, f"ran over the budget: {_one_line(str(exc))}")
    except torch.cuda.OutOfMemoryError as exc:
        return infeasible_row(cell, extra, f"out of device memory: {_one_line(str(exc))[:200]}")
    finally:
        if run is not None:
            # nothing reads the state back: copying it out beside the pinned pool would
            # need the model's state twice in host memory (a large cell was killed so)
            run.close(keep_state=False)
        del run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    warm = times[warmup:] or times[-1:]
    measured = statistics.median(warm)
    return {
        **row,
        "predicted_step_s": row["step_s"],
        "measured_step_s": measured,
        "ratio": measured / row["step_s"],
        "measured_tok_s": cell.tokens_step / measured,
        "steps_s": times,
        "losses": losses,
        "warmup": min(warmup, len(times) - len(warm)),
        "allocator_peak_bytes": max((p for p in peaks if p is not None), default=None),
    }


def measure(
    family: Any,
    cells: Iterable[Cell],
    hw: HardwareEntry,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Every cell's row (``measure_cell``; its ``on_event(cell, line)`` hears each cell
    planned and each step end), ``progress(row)`` after each."""
    return each_cell(measure_cell, family, cells, hw, progress, **options)
