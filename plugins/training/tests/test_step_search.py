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

from dataflow_training.drive.step_search import SEARCHED, NothingFits, search_for  # noqa: E402
from dataflow_training.drive.trainer import TrainOptions  # noqa: E402
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
    inside it (the search first plans it again inside a smaller slow budget) is passed
    over. Priced by a hardware entry's declared costs: measured ones move the plans, so
    which shape refits under the limit, from run to run."""
    entry = hardware("h200")
    declared = Pricing(device="cpu", cost=entry.roofline("float32"), links=entry.links())
    free, found = search_for(options(tmp_path), family, host_bytes=2**40, pricing=declared)
    limit = int(found.chosen.host_bytes * 0.8)
    limited, within = search_for(options(tmp_path), family, host_bytes=limit, pricing=declared)
    assert within.chosen is not None and within.chosen.host_bytes <= limit
    assert within.chosen.shape != found.chosen.shape
    excluded = [t for t in within.tried if t.host_bound]
    assert excluded and all(t.host_bytes > limit for t in excluded)


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
                    "--no-head-vocab-tiles", "--resolver", "torch", "--out", tmp_path / "pinned")  # fmt: skip
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
        "--optimizer-states bf16",
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
    return re.sub(r"; \d+ of \d+ candidates planned in [\d.]+ s$", "", line)


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
