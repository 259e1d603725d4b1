"""The hardware table: the shipped h200 entry, user entries, and what a bad file says."""

from __future__ import annotations

import pytest
from dataflow_training.plan.hardware import (
    HARDWARE_ENV,
    HardwareEntry,
    HardwareError,
    hardware,
    load_table,
)
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.lowering import lower
from dataflow_training.testing.toy import ToyFamily

H200_FIELDS = (
    "flops_per_us.bfloat16",
    "hbm_bytes_per_us",
    "h2d_bytes_per_us",
    "d2h_bytes_per_us",
    "duplex_bytes_per_us",
    "h2d_latency_us",
    "d2h_latency_us",
    "launch_us",
    "dispatch_us",
)


def test_the_h200_entry_cites_a_source_for_every_figure() -> None:
    h200 = hardware("h200")
    assert set(H200_FIELDS) <= set(h200.sources)
    for dtype in h200.flops_per_us:
        assert f"flops_per_us.{dtype}" in h200.sources
    # the figures the issue names, in the simulator's units (bytes/us = MB/s)
    assert h200.roofline("bfloat16").flops_per_us == 788e6
    assert h200.links().h2d.bw_bytes_per_us == pytest.approx(55.34e3, rel=1e-3)
    assert h200.duplex_bytes_per_us < h200.h2d_bytes_per_us + h200.d2h_bytes_per_us
    # the links carry the duplex limit, so the simulator shares it: each way about
    # 49.5 GB/s while both copy (engine_overhead.json raw_copy.both_GBps / 2)
    assert h200.links().duplex_bytes_per_us == h200.duplex_bytes_per_us
    assert h200.links().shared_bw == pytest.approx((49.47e3, 49.47e3), rel=1e-3)


def test_roofline_takes_the_largest_roof_plus_the_dispatch_gap() -> None:
    cost = RooflineCost(flops_per_us=100.0, bytes_per_us=10.0, launch_us=2.0, dispatch_us=5.0)
    assert cost.cost_us(1000, 50, kernels=1) == 5.0 + 10.0  # arithmetic-bound
    assert cost.cost_us(100, 500, kernels=1) == 5.0 + 50.0  # memory-bound
    assert cost.cost_us(100, 50, kernels=40) == 5.0 + 80.0  # launch-bound


def test_a_lowered_step_takes_the_entrys_costs_and_links() -> None:
    h200 = hardware("h200")
    train = TrainConfig(seq_len=16, batch=2, dtype=DtypePolicy.named("bf16"))
    plain = lower(ToyFamily(), "small", train).program
    priced = lower(ToyFamily(), "small", train, cost=h200.roofline(), links=h200.links()).program
    assert priced.links == h200.links()
    for a, b in zip(plain.tasks, priced.tasks, strict=True):
        # tiny tasks: the launch roof and the dispatch gap set the price
        assert b.cost_us >= a.cost_us + h200.dispatch_us


def test_user_entries_add_devices_and_replace_shipped_ones(tmp_path, monkeypatch) -> None:
    mine = tmp_path / "hw.toml"
    mine.write_text(
        "[mygpu]\nflops_per_us = { bfloat16 = 1e8 }\nhbm_bytes_per_us = 1e6\n"
        "h2d_bytes_per_us = 2.5e4\nd2h_bytes_per_us = 2.5e4\n"
        "[h200]\nflops_per_us = { bfloat16 = 5e8 }\nhbm_bytes_per_us = 4e6\n"
        "h2d_bytes_per_us = 5e4\nd2h_bytes_per_us = 5e4\n"
    )
    assert "mygpu" not in load_table()
    monkeypatch.setenv(HARDWARE_ENV, str(mine))
    table = load_table()
    assert table["mygpu"].roofline().flops_per_us == 1e8
    assert table["h200"].roofline().flops_per_us == 5e8
    assert hardware("mygpu", extra=[mine]).origin == str(mine)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[x]\nflops_per_us = { bfloat16 = 1e8 }\n", r"\[x\]: missing hbm_bytes_per_us"),
        (
            "[x]\nflops_per_us = { bfloat16 = 0 }\nhbm_bytes_per_us = 1\nh2d_bytes_per_us = 1\n"
            "d2h_bytes_per_us = 1\n",
            r"\[x\]: flops_per_us.bfloat16 must be a number > 0",
        ),
        (
            "[x]\nflops_per_us = { bfloat16 = 1 }\nhbm_bytes_per_us = 1\nh2d_bytes_per_us = 1\n"
            "d2h_bytes_per_us = 1\nlaunch = 3\n",
            r"\[x\]: unknown field\(s\) launch",
        ),
        (
            "[x]\nflops_per_us = { bfloat16 = 1 }\nhbm_bytes_per_us = 1\nh2d_bytes_per_us = 1\n"
            "d2h_bytes_per_us = 1\nduplex_bytes_per_us = -2\n",
            r"\[x\]: duplex_bytes_per_us must be a number > 0",
        ),
        ("[x\n", r"hw.toml: "),
    ],
)
def test_a_bad_table_names_its_file_entry_and_field(tmp_path, text, message) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message):
        load_table([path])


def test_the_collective_link_is_a_rings_algorithm_bandwidth() -> None:
    """n ranks reduce a buffer in a ring by sending 2 (n - 1) / n of it over each rank's
    link, so bytes reduced per us = busbw x n / (2 (n - 1)): 2 ranks reduce at busbw,
    8 at 4/7 of it; one rank copies in device memory (read + write)."""
    h200 = hardware("h200")
    for scope in ("nvlink", "network"):
        assert f"allreduce_busbw_bytes_per_us.{scope}" in h200.sources
        assert f"allreduce_latency_us.{scope}" in h200.sources
    busbw = h200.allreduce_busbw_bytes_per_us["nvlink"]
    assert h200.collective_link(2).bw_bytes_per_us == pytest.approx(busbw)
    assert h200.collective_link(8).bw_bytes_per_us == pytest.approx(busbw * 8 / 14)
    assert h200.collective_link(1).bw_bytes_per_us == h200.hbm_bytes_per_us / 2
    network = h200.collective_link(2, "network")
    assert network.latency_us == h200.allreduce_latency_us["network"]
    assert h200.links(8).collective == h200.collective_link(8)
    assert h200.links().collective is None
    with pytest.raises(HardwareError, match=r"no allreduce_busbw_bytes_per_us.nvlink"):
        HardwareEntry("bare", {"bfloat16": 1.0}, 1.0, 1.0, 1.0).collective_link(2)


def test_a_bad_collective_scope_is_named(tmp_path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(
        "[x]\nflops_per_us = { bfloat16 = 1 }\nhbm_bytes_per_us = 1\nh2d_bytes_per_us = 1\n"
        "d2h_bytes_per_us = 1\nallreduce_busbw_bytes_per_us = { infiniband = 5 }\n"
    )
    with pytest.raises(HardwareError, match=r"\[x\]: allreduce_busbw_bytes_per_us.infiniband: "):
        load_table([path])


def test_unknown_names_say_what_is_known(tmp_path) -> None:
    with pytest.raises(HardwareError, match=r"no hardware entry 'b300'; known: .*h200"):
        hardware("b300")
    with pytest.raises(HardwareError, match=r"has no flops_per_us.int8"):
        hardware("h200").roofline("int8")
    with pytest.raises(HardwareError, match=r"does not exist"):
        load_table([tmp_path / "none.toml"])
