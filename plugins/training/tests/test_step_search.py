"""The step search (``plan.search``, ``drive.step_search``) on gpt2_tiny on the CPU: the
same choice twice, every pinned option honoured, a host-memory limit (given, not the
machine's) that excludes shapes and a nothing-fits line that says what would, and
``dataflow predict``'s search the same as ``dataflow train``'s."""

from __future__ import annotations

import json
import re

import attrs
import pytest

from dataflow import plan
from dataflow.testing import invoke

pytest.importorskip("dataflow_family_gpt2")

from dataflow_training.drive.options import TrainOptions  # noqa: E402
from dataflow_training.drive.step_search import (  # noqa: E402
    SEARCH_CACHE_ENV,
    SEARCHED,
    NothingFits,
    search_for,
)
from dataflow_training.plan.hardware import hardware  # noqa: E402
from dataflow_training.plan.profile import CACHE_ENV  # noqa: E402
from dataflow_training.plan.search import Pricing  # noqa: E402
from dataflow_training.plan.shapes import context_length, published_tokens  # noqa: E402
from dataflow_training.step.family import load_family  # noqa: E402

BUDGET = 2 * 2**20  # the README main job's


@pytest.fixture(scope="module", autouse=True)
def _own_profile_cache(tmp_path_factory):
    """A profile cache of this module's own: CPU steps are priced by measurement, and
    another test process writing the same shapes' timings into a shared cache between
    two searches here would change what the second one reads."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profiles")))
        yield


@pytest.fixture(autouse=True)
def _no_search_cache(monkeypatch):
    """Each search here searches (the cache's own tests below turn it back on)."""
    monkeypatch.setenv(SEARCH_CACHE_ENV, "1")


@pytest.fixture(scope="module")
def family():
    return load_family("gpt2")


def options(tmp_path, **given) -> TrainOptions:
    """A gpt2_tiny run at the main job's budget with ``given`` pinned, the rest searched."""
    free = [name for name in SEARCHED if name not in given]
    return TrainOptions(
        family="gpt2",
        preset="gpt2_tiny",
        steps=1,
        out=tmp_path,
        budget_bytes=BUDGET,
        **given,
        search=free,
    )


def test_the_search_chooses_the_same_shape_twice(family, tmp_path) -> None:
    first, found = search_for(options(tmp_path), family, host_bytes=2**40)
    again, found_again = search_for(options(tmp_path), family, host_bytes=2**40)
    assert found.chosen == found_again.chosen and found.runner_up == found_again.runner_up
    assert attrs.evolve(first) == again
    assert not first.search  # every field chosen
    assert first.seq_len == context_length(family.config("gpt2_tiny")) == 128
    assert first.tokens_per_step == first.batch * first.rounds * first.seq_len
    assert first.tokens_per_step <= published_tokens("gpt2", "gpt2_tiny", 128)[0]
    line = found.line()
    assert line.startswith("search: seq 128 (the preset's context); batch ")
    assert "predicted" in line and "runner-up" in line


@pytest.mark.parametrize(
    "given",
    [
        {"batch": 4},
        {"rounds": 2},
        {"order": "layer"},
        {"order": "layer:2", "rounds": 4},
        {"updates": "end"},
        {"tokens_per_step": 512},
        {"seq_len": 32, "batch": 2, "rounds": 3},
        {"head_vocab_tiles": True},
        {"resolver": "torch"},
    ],
    ids=lambda given: ",".join(f"{k}={v}" for k, v in given.items()),
)
def test_every_pinned_option_is_honoured(family, tmp_path, given) -> None:
    chosen, found = search_for(options(tmp_path, **given), family, host_bytes=2**40)
    for name, value in given.items():
        assert getattr(chosen, name) == value, name
    assert found.chosen is not None
    assert chosen.tokens_per_step == chosen.batch * chosen.rounds * chosen.seq_len


def test_a_host_memory_limit_excludes_shapes(family, tmp_path) -> None:
    """A limit a fifth below what the free choice holds: a shape that cannot be planned
    inside it (the search first plans it again inside a smaller slow budget, and once one
    did, plans the later ones straight inside the slow budget the host leaves: those
    that do not plan there have no host figure) is passed over. Priced by a hardware
    entry's declared costs: measured ones move the plans, so which shape refits under
    the limit, from run to run."""
    entry = hardware("h200")
    declared = Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())
    free, found = search_for(options(tmp_path), family, host_bytes=2**40, pricing=declared)
    limit = int(found.chosen.host_bytes * 0.8)
    limited, within = search_for(options(tmp_path), family, host_bytes=limit, pricing=declared)
    assert within.chosen is not None and within.chosen.host_bytes <= limit
    assert within.chosen.shape != found.chosen.shape
    excluded = [t for t in within.tried if t.host_bound]
    assert excluded and all(t.host_bytes is None or t.host_bytes > limit for t in excluded)
    assert any(t.host_bytes is not None for t in excluded)  # the first is planned unbounded


def test_the_run_takes_the_search_s_plan_rather_than_plan_it_again(tmp_path, monkeypatch):
    """``compile_step`` finds the chosen shape's plan the search made (``plan_memo``):
    it plans nothing itself, and the run trains."""
    import dataflow_training.plan.compiled_step as compiled_step

    made = []

    def counted(*args, **kwargs):
        made.append(args[0].name)
        return plan(*args, **kwargs)

    monkeypatch.setattr(compiled_step, "plan", counted)
    out = tmp_path / "run"
    args = ["--preset", "gpt2_tiny", "--budget", "2MiB", "--device", "cpu", "--steps", "2"]
    result = invoke("train", *args, "--out", out)
    assert result.exit_code == 0, result.output
    assert "search: seq 128" in result.output
    assert made == []
    # a pinned shape is not searched: compile_step plans it
    result = invoke("train", *args, "--batch", "2", "--ga-rounds", "1", "--seq-len", "64",
                    "--order", "round", "--updates", "end", "--tokens-per-step", "128",
                    "--no-head-vocab-tiles", "--vocab-pieces", "1", "--resolver", "torch",
                    "--out", tmp_path / "pinned")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "search:" not in result.output
    assert len(made) == 1


def test_nothing_fits_says_what_would(family, tmp_path) -> None:
    with pytest.raises(NothingFits) as caught:
        search_for(options(tmp_path, order="round"), family, host_bytes=2**20)
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("nothing fits: every step that fits the 2 MiB budget needs more host")
    for remedy in (
        "a larger --budget",
        "a shorter --seq-len",
        "--order layer",
        "--optimizer-states bf16 or int8",
    ):
        assert remedy in line


def test_predict_checks_the_host_memory_of_its_hardware_entry(tmp_path) -> None:
    """``dataflow predict --hw`` searches for that entry's host (its ``host_memory_bytes``),
    never this machine's; where that host's memory is what nothing fits, the context is
    not halved (``e.g. 64``: half the preset's 128, said once)."""
    small = tmp_path / "hw.toml"
    small.write_text(
        "[tiny_host]\nflops_per_us = { float32 = 67e6 }\nhbm_bytes_per_us = 4.3e6\n"
        "h2d_bytes_per_us = 55339.0\nd2h_bytes_per_us = 55231.0\nhost_memory_bytes = 65536\n"
    )
    common = ["predict", "--preset", "gpt2_tiny", "--budget", "2MiB", "--hw-file", small]
    refused = invoke(*common, "--hw", "tiny_host", "--dtype", "fp32")
    assert refused.exit_code == 1, refused.output
    assert "needs more host memory than the 64 KiB available" in refused.output
    assert "a shorter --seq-len (e.g. 64)" in refused.output
    assert "Traceback" not in refused.output
    unstated = tmp_path / "unstated.toml"  # no host_memory_bytes: not checked
    unstated.write_text(small.read_text().replace("host_memory_bytes = 65536\n", ""))
    common[-1] = unstated
    searched = invoke(*common, "--hw", "tiny_host", "--dtype", "fp32")
    assert searched.exit_code == 0, searched.output
    assert searched.output.startswith("search: seq 128")


def test_nothing_fits_is_one_line_of_dataflow_train(tmp_path) -> None:
    result = invoke(
        *["train", "--preset", "gpt2_tiny", "--steps", "1", "--budget", "64KiB", "--device", "cpu",
         "--seq-len", "128", "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert result.exit_code == 1
    assert (
        "nothing fits: no step fits the 64 KiB budget; what would: a --budget of at "
        in result.output
    )
    assert "Traceback" not in result.output


def _search_line(output: str) -> str:
    line = next(x for x in output.splitlines() if x.startswith("search:"))
    return re.sub(
        r"; \d+ of \d+ candidates planned in [\d.]+ s(; from the search cache)?$", "", line
    )


def test_predict_searches_as_train_does(tmp_path) -> None:
    common = ["--preset", "gpt2_tiny", "--budget", "2MiB", "--device", "cpu"]
    trained = invoke("train", *common, "--steps", "1", "--out", tmp_path / "run")
    assert trained.exit_code == 0, trained.output
    # train's defaults: fp32 weights and optimizer states
    predicted = invoke("predict", *common, "--dtype", "fp32", "--json", tmp_path / "p.json")
    assert predicted.exit_code == 0, predicted.output
    assert _search_line(predicted.output) == _search_line(trained.output)
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [row["role"] for row in rows] == ["chosen", "runner-up"]
    manifest = json.loads(next((tmp_path / "run").glob("**/manifest.json")).read_text())
    options = manifest["options"]
    chosen = rows[0]
    assert (options["batch"], options["rounds"], options["order"]) == (
        chosen["batch"], chosen["rounds"], chosen["order"]
    )  # fmt: skip


def test_predict_without_a_gpu_or_device_prices_for_the_hw_entry(tmp_path) -> None:
    """With no CUDA device and no --device, the search is priced by the --hw entry's
    roofline (as --hw h200 names it), not by profiling this CPU, and says so."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: predict prices for it")
    common = ["--preset", "gpt2_tiny", "--budget", "2MiB", "--dtype", "fp32"]
    plain = invoke("predict", *common)
    assert plain.exit_code == 0, plain.output
    assert "no CUDA device here: the search is priced for the hardware entry 'h200'" in (
        plain.output
    )
    named = invoke("predict", *common, "--hw", "h200")
    assert named.exit_code == 0, named.output
    assert "no CUDA device here" not in named.output
    assert _search_line(plain.output) == _search_line(named.output)
    on_cpu = invoke("predict", *common, "--device", "cpu")
    assert on_cpu.exit_code == 0, on_cpu.output
    assert "no CUDA device here" not in on_cpu.output


def test_a_pinned_batch_on_the_command_line_is_the_run_s(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["train", "--preset", "gpt2_tiny", "--budget", "2MiB", "--device", "cpu"]
    result = invoke(*args, "--steps", "1", "--batch", "3", "--out", out)
    assert result.exit_code == 0, result.output
    assert "search: seq 128 (the preset's context); batch 3 x " in result.output
    resumed = invoke("train", "--out", out, "--resume", "auto", "--steps", "2")
    assert resumed.exit_code == 0, resumed.output
    assert "search:" not in resumed.output  # the manifest's shape


@pytest.mark.gpu
def test_on_a_gpu_the_search_prices_both_resolvers_by_their_profiles(tmp_path) -> None:
    """On CUDA every candidate is priced by the profiling pass (price_on_cuda) for each
    resolver, and the choice is what the run then compiles: its resolver and shape are
    in the manifest, its plan line on cuda."""
    out = tmp_path / "run"
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--steps", "3", "--budget", "64MiB", "--out", out
    )
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("search:"))
    assert re.search(r"resolver torch(-compiled)?: predicted", line), line
    assert "plan: gpt2-gpt2_tiny-train on cuda (measured): predicted" in result.output
    manifest = json.loads(next(out.glob("**/manifest.json")).read_text())
    assert manifest["options"]["resolver"] in ("torch", "torch-compiled")
    assert manifest["options"]["search"] == []


def _limited_options(family, tmp_path):
    """gpt2_tiny's options at a host limit a fifth below what its free choice holds,
    priced by a hardware entry (``test_a_host_memory_limit_excludes_shapes``), and that
    pricing: a search that meets host-bound plans."""
    entry = hardware("h200")
    declared = Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())
    _, found = search_for(options(tmp_path), family, host_bytes=2**40, pricing=declared)
    limited = attrs.evolve(options(tmp_path), host_bytes=int(found.chosen.host_bytes * 0.8))
    return limited, declared


@pytest.mark.parametrize("jobs", ["2", "3"])
def test_plans_made_ahead_in_workers_choose_as_one_after_another(
    family, tmp_path, monkeypatch, jobs
):
    """``DATAFLOW_SEARCH_JOBS``: candidates planned ahead in forked workers, the sequential
    decision replayed over their results: every candidate tried, the choice and the
    runner-up are those of the search that plans one after another, here where host-bound
    plans change how later ones are planned (``straight``) and with measured pricing."""
    limited, declared = _limited_options(family, tmp_path)
    found = {}
    for each in ("1", jobs):
        monkeypatch.setenv("DATAFLOW_SEARCH_JOBS", each)
        found[each] = [
            search_for(limited, family, pricing=declared)[1],
            search_for(options(tmp_path), family, host_bytes=2**40)[1],
        ]
    for one, many in zip(found["1"], found[jobs], strict=True):
        assert many.tried == one.tried
        assert (many.chosen, many.runner_up) == (one.chosen, one.runner_up)
    assert any(t.slow_budget_bytes is not None for t in found["1"][0].tried)


def test_a_bad_search_jobs_value_is_named(family, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DATAFLOW_SEARCH_JOBS", "two")
    with pytest.raises(ValueError, match="DATAFLOW_SEARCH_JOBS='two': give the number"):
        search_for(options(tmp_path), family, host_bytes=2**40)


def test_a_plan_made_in_a_worker_pickles_whole(family, tmp_path) -> None:
    """What a worker sends back: the plan pickled without its planner (a closure), read
    back equal to the plan (``Plan.spec`` takes no part in equality) and the planner the
    search gives it back."""
    import pickle

    from dataflow_training.plan.search import Searcher
    from dataflow_training.plan.shapes import Shape

    o = options(tmp_path)
    searcher = Searcher(
        family, "gpt2_tiny", attrs.evolve(o, seq_len=128).train_config(family),
        budget_bytes=BUDGET, host_bytes=2**40,
    )  # fmt: skip
    shape = Shape(256, 2, 1, "round", "end", False, "torch")
    assert searcher.try_shape(shape, 1.0).reason is None
    [(_, made)] = searcher.plans_of(shape)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(made)  # its planner is a closure
    back = pickle.loads(pickle.dumps(attrs.evolve(made, spec=None)))
    assert back == made and back.sim == made.sim and back.program == made.program


def test_compile_step_plans_nothing_the_search_planned_for_a_host_bound_shape(
    family, tmp_path, monkeypatch
) -> None:
    """A CPU run whose search meets the host's memory (a limit a fifth below what the free
    choice holds): the chosen shape's plan was made inside a slow budget
    (``Tried.slow_budget_bytes``, carried as ``search_slow_bytes``), and ``compile_step``
    plans there first and finds every plan the search made of it: it plans nothing."""
    import dataflow_training.plan.compiled_step as compiled_step

    limited, declared = _limited_options(family, tmp_path)
    made = []

    def counted(*args, **kwargs):
        made.append(kwargs.get("slow_budget_bytes"))
        return plan(*args, **kwargs)

    monkeypatch.setattr(compiled_step, "plan", counted)
    for jobs in ("1", "2"):  # the plans made here, and those made in workers
        monkeypatch.setenv("DATAFLOW_SEARCH_JOBS", jobs)
        chosen, found = search_for(limited, family, pricing=declared)
        assert chosen.search_slow_bytes == found.chosen.slow_budget_bytes is not None
        compiled = chosen.compile(family, cost=declared.cost, links=declared.links)
        assert made == []
        assert compiled.backing_bytes == chosen.search_slow_bytes
        assert compiled.plan.slow_budget_bytes == chosen.search_slow_bytes
    # without the search's slow budget: planned, unbounded (a CPU has no host limit)
    attrs.evolve(chosen, search_slow_bytes=None).compile(
        family, cost=declared.cost, links=declared.links
    )
    assert made == [None]


def _declared() -> Pricing:
    entry = hardware("h200")
    return Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())


def test_a_second_search_of_the_same_inputs_comes_from_the_cache(
    family, tmp_path, monkeypatch
) -> None:
    """The search cache (``search_cache``): the same inputs again give the same search at
    once, said in its line, and the same options (the slow budget too); a change of any
    input (budget, host, pricing, a pin) searches again."""
    monkeypatch.delenv(SEARCH_CACHE_ENV)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    limited, declared = _limited_options(family, tmp_path)
    first, found = search_for(limited, family, pricing=declared)
    assert not found.from_cache
    assert list((tmp_path / "profiles" / "searches").glob("*.json"))
    again, kept = search_for(limited, family, pricing=declared)
    assert kept.from_cache and kept.line() == found.line() + "; from the search cache"
    assert attrs.evolve(kept, from_cache=False) == found
    assert again == first and again.search_slow_bytes is not None
    entry = attrs.evolve(hardware("h200"), h2d_bytes_per_us=hardware("h200").h2d_bytes_per_us / 2)
    changed = [
        (attrs.evolve(limited, budget_bytes=BUDGET * 2), declared),
        (attrs.evolve(limited, host_bytes=limited.host_bytes + 1), declared),
        (limited, Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())),
        (attrs.evolve(limited, batch=2, search=[f for f in limited.search if f != "batch"]), declared),
    ]  # fmt: skip
    for o, pricing in changed:
        assert not search_for(o, family, pricing=pricing)[1].from_cache


def test_a_corrupt_search_cache_file_is_said_and_written_again(
    family, tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv(SEARCH_CACHE_ENV)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    o, declared = options(tmp_path), _declared()
    _, found = search_for(o, family, host_bytes=2**40, pricing=declared)
    [path] = (tmp_path / "profiles" / "searches").glob("*.json")
    path.write_text(path.read_text()[:40])
    with pytest.warns(RuntimeWarning, match=f"cache file {path} could not be read"):
        _, again = search_for(o, family, host_bytes=2**40, pricing=declared)
    assert not again.from_cache and again.chosen == found.chosen
    _, kept = search_for(o, family, host_bytes=2**40, pricing=declared)
    assert kept.from_cache and kept.chosen == found.chosen


def test_predict_twice_says_the_second_came_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SEARCH_CACHE_ENV)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    args = ["predict", "--preset", "gpt2_tiny", "--budget", "2MiB", "--hw", "h200"]
    lines = []
    for _ in range(2):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        lines.append(result.output.splitlines()[0])
    assert lines[1] == lines[0] + "; from the search cache"
    # the cache off (the profile cache's folder: off): searched each time
    monkeypatch.setenv(CACHE_ENV, "off")
    # (the search's own seconds at the line's end differ from run to run)
    assert _search_line(invoke(*args).output.splitlines()[0]) == _search_line(lines[0])


@pytest.mark.parametrize(
    "trains",
    [
        ("--lora", "4"),
        ("--freeze", "embed", "--freeze", "layers.0"),
        ("--optimizer", "lion"),
        ("--precision", "mixed"),
    ],
    ids=["lora", "freeze", "lion", "mixed"],
)
def test_predict_searches_what_trains_as_train_does(tmp_path, trains) -> None:
    """What trains (``--lora``, ``--freeze``), by which optimizer and at which precision:
    ``predict``'s search takes them as ``train``'s does, to the same choice."""
    common = ["--preset", "gpt2_tiny", "--budget", "2MiB", "--device", "cpu", *trains]
    trained = invoke("train", *common, "--steps", "1", "--out", tmp_path / "run")
    assert trained.exit_code == 0, trained.output
    pins = () if "--precision" in trains else ("--dtype", "fp32")  # train's cpu default
    predicted = invoke("predict", *common, *pins)
    assert predicted.exit_code == 0, predicted.output
    assert _search_line(predicted.output) == _search_line(trained.output)
