"""``dataflow_training.drive.trainer.train`` in Python, on gpt2_tiny and the CPU: the plan
line's recomputed layers, and TensorBoard events (with tensorboard installed) or none
(without), a resumed run's events purged past its checkpoint. The lr schedule is
test_schedule.py's."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")

from dataflow_training.drive.components import TENSORBOARD_SCALARS  # noqa: E402
from dataflow_training.drive.options import TrainOptions  # noqa: E402
from dataflow_training.drive.trainer import plan_line, recomputed_layers, train  # noqa: E402
from dataflow_training.plan.compiled_step import UNBOUNDED_BYTES, compile_step  # noqa: E402
from dataflow_training.step.config import TrainConfig  # noqa: E402
from dataflow_training.step.costs import RooflineCost  # noqa: E402
from dataflow_training.step.family import load_family  # noqa: E402
from dataflow_training.step.lowering import lower  # noqa: E402


@pytest.mark.parametrize(("recompute", "listed"), [((), "none"), ((1,), "1"), ((0, 1), "0, 1")])
def test_plan_line_lists_the_recomputed_layers(recompute, listed):
    from dataflow import PRESSUREFIT, plan

    train_config = TrainConfig(seq_len=16, batch=2, rounds=2)
    lowered = lower(load_family("gpt2"), "gpt2_tiny", train_config, recompute=recompute)
    assert recomputed_layers(lowered.layout) == [str(i) for i in recompute]
    planned = plan(lowered.program, UNBOUNDED_BYTES, planner=PRESSUREFIT)
    compiled = compile_step(
        load_family("gpt2"), "gpt2_tiny", train_config, recompute=False, cost=RooflineCost()
    )
    compiled = attrs.evolve(
        compiled,
        running=lowered.with_program(planned.program),
        placement=SimpleNamespace(plan=planned),
    )
    line = plan_line(compiled)
    assert line.startswith("plan: gpt2-gpt2_tiny-train on cpu (declared costs, not measured): ")
    assert line.endswith(f"recomputed layers: {listed}"), line
    assert "of unbounded" in line


def _options(tmp_path: Path, steps: int, **extra) -> TrainOptions:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes() * 8)
    return TrainOptions(
        family="gpt2",
        preset="gpt2_tiny",
        steps=steps,
        out=tmp_path / "run",
        data=f"text:{corpus}",
        batch=2,
        seq_len=16,
        lr=3e-3,
        **extra,
    )


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    printed = io.StringIO()
    options = _options(tmp_path, 4, checkpoint_every=2)
    train(options, out=printed)
    board = options.out / "tensorboard"
    assert f"TensorBoard events in {board}" in printed.getvalue()
    assert sorted(_scalars(board)) == sorted(TENSORBOARD_SCALARS)
    # an interrupted run's later events are purged when a run resumes from step 2; its
    # events file must be named (by the second it opens) after the first, as in real use
    time.sleep(1.05)
    train(attrs_evolve(options, steps=6, resume=str(options.out / "step_000002")), out=printed)
    assert f"replacing {options.out / 'step_000004'}" in printed.getvalue()
    scalars, metrics = _scalars(board), _metrics(options.out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for name in TENSORBOARD_SCALARS:
        assert [step for step, _ in scalars[name]] == [1, 2, 3, 4, 5, 6], name
        for (_, value), m in zip(scalars[name], metrics, strict=True):
            assert value == pytest.approx(m[name], rel=1e-6), name  # stored as float32


def attrs_evolve(options: TrainOptions, **changes) -> TrainOptions:
    import attrs

    return attrs.evolve(options, **changes)


def test_without_tensorboard_there_are_no_events_and_the_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    printed = io.StringIO()
    options = _options(tmp_path, 2)
    summary = train(options, out=printed)
    assert summary["last"]["step"] == 2
    assert "(pip install tensorboard for TensorBoard events)" in printed.getvalue()
    assert not (options.out / "tensorboard").exists()
