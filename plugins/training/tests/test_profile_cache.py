"""The profiling pass's disk cache: a hit skips the measurement, and a change of kernel
set, device or method version (or a damaged file) is a miss that measures again."""

from __future__ import annotations

import json

import pytest
from dataflow_training.plan import profile
from dataflow_training.plan.profile import (
    CACHE_ENV,
    ProfileCache,
    apply_profile,
    default_cache_dir,
    profile_program,
    signature,
)
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.lowering import lower
from dataflow_training.testing.toy import ToyFamily

#: Launches of one signature measured on the CPU (``_profile``'s 2 repeats): a warm-up
#: and one to six more until two agree (a counting executable's launches take only the
#: hand-over to the worker), then at least 2 timed, more while they took under
#: HOST_TIMED_S, up to the cap
PER_SIGNATURE = range(2 + 2, 2 + profile.HOST_SETTLE_LAUNCHES + profile.HOST_MAX_REPEATS)


def measured_once_each(resolver: Counting, signatures: int) -> bool:
    """Whether ``resolver``'s launches are those of ``signatures`` measured once each."""
    low, high = PER_SIGNATURE[0], PER_SIGNATURE[-1]
    return low * signatures <= resolver.launches <= high * signatures


class Counting:
    """A resolver whose executables only count their launches."""

    def __init__(self) -> None:
        self.launches = 0

    def __call__(self, task):
        outer = self

        class Executable:
            def launch(self, ctx) -> None:
                outer.launches += 1

        return Executable()


@pytest.fixture
def step():
    return lower(ToyFamily(), "small", TrainConfig(seq_len=8, batch=2, rounds=2))


def _profile(step, cache, resolver=None):
    resolver = resolver or Counting()
    return profile_program(step, resolver, device="cpu", repeats=2, cache=cache), resolver


def test_a_second_run_takes_every_signature_from_disk(step, tmp_path) -> None:
    unique = {signature(step, t) for t in step.program.tasks}
    first, measured = _profile(step, ProfileCache(tmp_path, "cpu-a", ("k1",)))
    assert measured_once_each(measured, len(unique))
    assert len(list(tmp_path.glob("*.json"))) == len(unique)
    cache = ProfileCache(tmp_path, "cpu-a", ("k1",))
    second, again = _profile(step, cache)
    assert again.launches == 0
    assert (cache.hits, cache.misses) == (len(unique), 0)
    assert second == first
    assert apply_profile(step, second) == apply_profile(step, first)


@pytest.mark.parametrize(
    "changed",
    [
        {"device": "cpu-b"},
        {"kernels": ("k2",)},
        {"version": profile.PROFILE_VERSION + 1},
        {"code": "edited"},
    ],
)
def test_kernel_set_device_or_version_change_is_a_miss(step, tmp_path, changed, monkeypatch):
    _profile(step, ProfileCache(tmp_path, "cpu-a", ("k1",), code="original"))
    if "version" in changed:
        monkeypatch.setattr(profile, "PROFILE_VERSION", changed["version"])
    cache = ProfileCache(
        tmp_path,
        changed.get("device", "cpu-a"),
        changed.get("kernels", ("k1",)),
        code=changed.get("code", "original"),
    )
    _, measured = _profile(step, cache)
    unique = len({signature(step, t) for t in step.program.tasks})
    assert (cache.hits, cache.misses) == (0, unique)
    assert measured_once_each(measured, unique)


def test_a_damaged_entry_is_measured_and_written_again(step, tmp_path) -> None:
    first, _ = _profile(step, ProfileCache(tmp_path, "cpu-a", ("k1",)))
    files = sorted(tmp_path.glob("*.json"))
    files[0].write_text("{not json")
    other = json.loads(files[1].read_text())
    files[1].write_text(json.dumps({**other, "key": "another signature"}))  # a collision
    cache = ProfileCache(tmp_path, "cpu-a", ("k1",))
    _, measured = _profile(step, cache)
    assert cache.misses == 2 and measured_once_each(measured, 2)
    json.loads(files[0].read_text())  # rewritten whole
    third = ProfileCache(tmp_path, "cpu-a", ("k1",))
    _profile(step, third)
    assert third.misses == 0


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(CACHE_ENV, "off")
    assert default_cache_dir() is None
    assert ProfileCache.for_device("cpu", "torch") is None
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "dataflow" / "profiles"


def test_the_real_cache_key_names_the_device_and_kernels(tmp_path) -> None:
    cache = ProfileCache.for_device("cpu", "torch", tmp_path)
    assert cache.context["device"].startswith("cpu ")
    assert cache.context["kernels"][0] == "resolver torch"
    assert cache.context["version"] == profile.PROFILE_VERSION
    assert cache.context["host_method"] == profile.HOST_METHOD_VERSION  # a CPU's alone
    assert cache.context["code"] == profile.code_fingerprint("torch", "cpu")


def test_the_code_fingerprint_follows_the_familys_source(tmp_path, monkeypatch) -> None:
    """A family's source edited between two runs is another key (the old measurement
    priced code that no longer runs); the same source gives the same key."""
    import importlib

    package = tmp_path / "fingerprinted_family"
    package.mkdir()
    source = package / "__init__.py"
    source.write_text("class Family:\n    cost = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fingerprinted_family")
    family = module.Family()
    first = profile.code_fingerprint("torch", "cpu", family)
    assert profile.code_fingerprint("torch", "cpu", family) == first
    assert profile.code_fingerprint("torch", "cpu") != first
    source.write_text("class Family:\n    cost = 2\n")
    assert profile.code_fingerprint("torch", "cpu", family) != first


@pytest.mark.gpu
def test_task_inputs_are_filled_on_the_gpu_with_small_noise(step) -> None:
    """On CUDA a task's floating buffers are drawn on the device (N(0, 0.02)), the same
    for the same seed; integer buffers within ``int_high``."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    layout, device = step.layout, torch.device("cuda")
    task = step.program.tasks[0]
    filled = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(3)
        filled.append(
            {
                o: profile._filled(step.program, layout, o, device, generator, lambda _o: 7)
                for o in task.uses
            }
        )
    for obj_id, buffer in filled[0].items():
        assert buffer.device.type == "cuda"
        torch.testing.assert_close(buffer, filled[1][obj_id], rtol=0, atol=0)
        obj = step.program.obj(obj_id)
        if obj.tensor is not None and obj.tensor.dtype.startswith(("float", "bfloat")):
            from dataflow import typed_view

            values = typed_view(buffer, obj).float()
            if values.numel() > 1000:
                assert 0.015 < values.std().item() < 0.025, obj_id


def test_the_same_tokens_split_differently_is_another_signature() -> None:
    """64 x 1024 and 16 x 4096 tokens give every task the same bytes, but attention four
    times the work per token: a cached cost of one must not price the other."""
    wide = lower(ToyFamily(), "small", TrainConfig(seq_len=8, batch=4, rounds=1))
    long = lower(ToyFamily(), "small", TrainConfig(seq_len=16, batch=2, rounds=1))
    sizes = [o.size_bytes for o in wide.program.objects]
    assert sizes == [o.size_bytes for o in long.program.objects]
    for a, b in zip(wide.program.tasks, long.program.tasks, strict=True):
        assert signature(wide, a) != signature(long, b)


def test_without_workspace_drops_every_workspace_and_names_the_largest() -> None:
    from dataflow_training.plan.profile import TaskProfile, without_workspace

    profiles = {("a",): TaskProfile(5.0, 512), ("b",): TaskProfile(7.0, 3 << 20)}
    stripped, largest = without_workspace(profiles)
    assert largest == 3 << 20
    assert stripped == {("a",): TaskProfile(5.0, 0), ("b",): TaskProfile(7.0, 0)}
    assert without_workspace({}) == ({}, 0)


@pytest.mark.gpu
def test_a_task_whose_capture_fails_keeps_its_dispatched_timing(step) -> None:
    """A task that says it is capturable but reads a device tensor on the host (as
    grouped_mm's reference loop reads its offsets) cannot be captured: the profiling pass
    keeps the dispatched launches' time instead of failing the run (the engine's capture
    of the step then fails the same way and it dispatches)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow import LaunchContext

    device = torch.device("cuda")
    counts = torch.arange(8, device=device)
    launched = []

    class Syncing:
        capturable = True

        def launch(self, ctx) -> None:
            with torch.cuda.stream(ctx.stream or torch.cuda.current_stream(device)):
                launched.append(int(counts.sum()))  # a host read: refused while capturing

    ctx = LaunchContext(
        task=step.program.tasks[0], device="cuda", stream=None, inputs=(), mutates=(), outputs=()
    )
    found = profile._measure(Syncing(), ctx, device, 3, replay=True)
    assert found.cost_us > 0
    assert launched[:4] == [28, 28, 28, 28]  # the warm-up and the three timed launches
    torch.cuda.synchronize(device)  # the device is usable after the refused capture
    assert int((counts * 2).sum()) == 56


class Recording:
    """The torch resolver's executables, keeping a copy of every AuxTemp each task reads
    (by task id) before it runs."""

    def __init__(self, step) -> None:
        from dataflow import resolvers

        self.build = resolvers().get("torch").build(step)
        self.layout, self.read = step.layout, {}

    def __call__(self, task):
        inner, outer = self.build(task), self
        names = [o for o in task.inputs if o.startswith("AuxTemp_")]

        class Executable:
            def launch(self, ctx) -> None:
                seen = dict(zip(task.inputs, ctx.inputs, strict=True))
                for o in names:
                    views = outer.layout.packed[o].layout.views(seen[o].view(-1))
                    outer.read[task.id] = {k: v.clone() for k, v in views.items()}
                inner.launch(ctx)

        return Executable()


def test_a_task_reading_aux_temp_is_timed_on_its_forward_decisions() -> None:
    """Recompute and backward read the routing that forward decided; noise there is no
    routing (ids all 0 send both of a token's top-2 slots to one expert). The profiling
    pass gives them the decisions the block's forward task makes on filled inputs."""
    pytest.importorskip("dataflow_resolver_torch")
    import torch
    from dataflow_training.testing.toy_moe import ToyMoEFamily

    family = ToyMoEFamily()
    step = lower(family, "toy_moe_tiny", TrainConfig(seq_len=8, batch=2, rounds=2))
    recording = Recording(step)
    profile_program(step, recording, device="cpu", repeats=1, int_high=lambda o: 41)
    readers = {t.id for t in step.program.tasks if any(o.startswith("AuxTemp_") for o in t.inputs)}
    assert recording.read and set(recording.read) <= readers  # one task a signature
    config = family.config("toy_moe_tiny")
    for task_id, aux in recording.read.items():
        ids = aux["ids"].long().reshape(-1, config.top_k)
        assert (ids[:, 0] != ids[:, 1]).all(), task_id  # two distinct experts a token
        assert ids.min() >= 0 and ids.max() < config.experts
        sums = aux["weights"].float().reshape(-1, config.top_k).sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_a_settled_measurement_runs_the_task_back_to_back_first(step) -> None:
    """``settle_s`` launches the task back to back for that long before the timed
    launches (the clocks of a loaded device); ``flush_l2`` overwrites a buffer of twice
    the L2 cache before each timed launch, between the launches."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow import LaunchContext

    device = torch.device("cuda")
    work = torch.zeros(1 << 20, device=device)
    launched = []

    class Adding:
        def launch(self, ctx) -> None:
            launched.append(time.perf_counter())
            work.add_(1.0)

    ctx = LaunchContext(
        task=step.program.tasks[0], device="cuda", stream=None, inputs=(), mutates=(), outputs=()
    )
    plain = profile._measure(Adding(), ctx, device, 3)
    assert len(launched) == 4 and plain.cost_us > 0
    launched.clear()
    timing = profile._Timing.on(device, 0.05, True)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    assert timing.scratch is not None and timing.scratch.numel() == 2 * l2
    settled = profile._measure(Adding(), ctx, device, 3, timing=timing)
    assert settled.cost_us > 0
    assert len(launched) > 4 + 4  # the warm-up, at least a batch of four, three timed
    # the settling launches took settle_s (from just before the first of them)
    assert launched[-3] - launched[1] >= 0.04
    assert timing.scratch[-1].item() == 1  # overwritten before the timed launches
    assert int(work[0].item()) == 4 + len(launched)  # and the plain measurement's four


@pytest.mark.gpu
def test_a_task_that_cannot_be_captured_is_timed_dispatched_after_settling(step) -> None:
    """With ``replay`` asked, a task whose capture fails keeps dispatched timings: those
    are taken again after the settling launches (the first ones measured the workspace)."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow import LaunchContext

    device = torch.device("cuda")
    work = torch.zeros(1 << 20, device=device)
    launched, refused = [], []

    class Uncapturable:
        def launch(self, ctx) -> None:
            if torch.cuda.is_current_stream_capturing():
                refused.append(time.perf_counter())
                raise RuntimeError("reads the device on the host")
            launched.append(time.perf_counter())
            work.add_(1.0)

    ctx = LaunchContext(
        task=step.program.tasks[0], device="cuda", stream=None, inputs=(), mutates=(), outputs=()
    )
    timing = profile._Timing.on(device, 0.05, False)
    measured = profile._measure(Uncapturable(), ctx, device, 3, replay=True, timing=timing)
    assert measured.cost_us > 0 and len(refused) == 1
    after = [t for t in launched if t > refused[0]]
    assert len(after) > 3  # settling launches, then the three timed
    assert after[-3] - after[0] >= 0.04


def test_the_busiest_task_is_the_signature_with_the_most_time_in_all() -> None:
    """Cost times count: a task that is cheap but repeated every round outweighs a dearer
    one that runs once; the launcher runs the task it is given on its own buffers."""
    from dataflow_training.plan.profile import TaskProfile, busiest_task, task_launcher

    step = lower(ToyFamily(), "small", TrainConfig(seq_len=8, batch=2, rounds=4))
    keys = {signature(step, t) for t in step.program.tasks}
    counts = {k: sum(signature(step, t) == k for t in step.program.tasks) for k in keys}
    once = next(k for k, n in counts.items() if n == 1)
    often = max(keys, key=counts.__getitem__)
    assert counts[often] >= 4
    profiles = {k: TaskProfile(0.1, 0) for k in keys}
    profiles[often] = TaskProfile(1.0, 0)
    profiles[once] = TaskProfile(1.5 * counts[often], 0)  # dearest per launch and in all
    assert signature(step, busiest_task(step, profiles)) == once
    profiles[once] = TaskProfile(0.5 * counts[often], 0)  # dearest per launch only
    chosen = busiest_task(step, profiles)
    assert chosen == next(t for t in step.program.tasks if signature(step, t) == often)
    resolver = Counting()
    launch = task_launcher(step, resolver, chosen, device="cpu")
    launch(None)
    launch(None)
    assert resolver.launches == 2


def test_profile_program_points_a_bare_program_to_the_core_measure() -> None:
    from dataflow.testing import tiny_chain

    with pytest.raises(TypeError, match=r"not a Program: .*priced_by_measurement"):
        profile_program(tiny_chain(), lambda task: None, device="cpu")


@pytest.mark.gpu
def test_a_replayed_task_s_workspace_is_its_capture_s_where_that_takes_more(step) -> None:
    """A task that allocates more while captured than dispatched (the segmented attention:
    its varlen layout is read on the host, so a graph runs the masked kernel) is priced
    with the capture's workspace: the step replays the captured launch."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow import LaunchContext

    device = torch.device("cuda")
    work = torch.zeros(1 << 10, device=device)
    captured_bytes, dispatched_bytes = 64 << 20, 4 << 20

    class CapturedTakesMore:
        def launch(self, ctx) -> None:
            capturing = torch.cuda.is_current_stream_capturing()
            scratch = torch.ones(
                (captured_bytes if capturing else dispatched_bytes) // 4, device=device
            )
            work.add_(scratch[: work.numel()])

    ctx = LaunchContext(
        task=step.program.tasks[0], device="cuda", stream=None, inputs=(), mutates=(), outputs=()
    )
    dispatched = profile._measure(CapturedTakesMore(), ctx, device, 3)
    replayed = profile._measure(CapturedTakesMore(), ctx, device, 3, replay=True)
    assert dispatched_bytes <= dispatched.workspace_bytes < captured_bytes
    assert captured_bytes <= replayed.workspace_bytes < captured_bytes + (8 << 20)

    # a product allocates nothing of its own; the capture's fresh stream gets cuBLAS's
    # workspace before the capture, not inside its peak (runtime_reserve_bytes has it)
    a = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)

    class Product:
        def launch(self, ctx) -> None:
            torch.matmul(a, a, out=out)

    product = profile._measure(Product(), ctx, device, 3, replay=True)
    # the H100 (torch 2.11) measured 1 KiB, two rounding units: something of the capture's
    # own; cuBLAS's workspace (32 MiB on Hopper) would be thousands of times that
    assert product.workspace_bytes < 1 << 20
