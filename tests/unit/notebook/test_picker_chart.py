"""The picker's chart, built from hand-made estimates: which bytes each bar stacks on GPU and CPU
ranks, the bars' labels, and the free and usable memory lines."""

from __future__ import annotations

import pytest

from jupyter_shard.notebook.picker_chart import bar_label, held, memory_figure
from jupyter_shard.planner.estimate import HEADROOM, Bytes, Estimate, Plan
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.spec import Device, Offload, Precision

GIB = 2**30


NOTHING = Bytes()
GPU_FREE = FreeMemory(Device.CUDA, 40 * GIB, None, "nvidia-smi")


def _estimate(plan: Plan, device: Bytes, host: Bytes = NOTHING) -> Estimate:
    return Estimate(plan, 10**9, 4, Precision.BF16_MIXED, device, host, NOTHING)


DDP = _estimate(Plan("ddp"), Bytes(2 * GIB, 2 * GIB, 12 * GIB))
ZERO3 = _estimate(
    Plan("deepspeed", zero_stage=3, offload=Offload.CPU), Bytes(0, GIB, 0), Bytes(GIB // 2, 0, 3 * GIB)
)


def test_a_bar_is_marked_when_recommended_and_when_chosen() -> None:
    assert bar_label(DDP, None, None) == "DDP"
    assert bar_label(DDP, None, DDP.plan) == "★ DDP"
    assert bar_label(DDP, DDP, DDP.plan) == "★ ▶ DDP"
    assert bar_label(ZERO3, DDP, DDP.plan) == "ZeRO-3 + CPU offload"
    assert bar_label(ZERO3, ZERO3, DDP.plan) == "▶ ZeRO-3 + CPU offload"


def test_offloaded_bytes_count_against_a_cpu_ranks_memory_only() -> None:
    assert held(ZERO3, "optimizer", Device.CUDA) == 0
    assert held(ZERO3, "optimizer", Device.CPU) == 3 * GIB
    assert held(ZERO3, "params", Device.CPU) == GIB // 2
    assert held(ZERO3, "grads", Device.CUDA) == held(ZERO3, "grads", Device.CPU) == GIB


def test_the_bars_stack_each_component_in_gib_in_the_tables_order() -> None:
    figure = memory_figure([DDP, ZERO3], ZERO3, DDP.plan, GPU_FREE)
    bars = {trace["name"]: trace for trace in figure["data"]}
    assert list(bars) == ["parameters", "gradients", "optimizer state"]
    assert bars["parameters"]["y"] == ["★ DDP", "▶ ZeRO-3 + CPU offload"]
    assert [bars[name]["x"] for name in bars] == [[2.0, 0.0], [2.0, 1.0], [12.0, 0.0]]
    assert all(trace["orientation"] == "h" for trace in figure["data"])
    assert figure["layout"]["barmode"] == "stack"
    assert figure["layout"]["yaxis"]["autorange"] == "reversed"  # the first row on top, as in the table


def test_on_cpu_ranks_the_bars_include_offloaded_state() -> None:
    figure = memory_figure([ZERO3], None, None, FreeMemory(Device.CPU, 8 * GIB, 32 * GIB, "psutil"))
    assert [trace["x"] for trace in figure["data"]] == [[0.5], [1.0], [3.0]]


def test_lines_mark_the_free_memory_and_the_share_a_plan_may_use() -> None:
    figure = memory_figure([DDP], None, None, GPU_FREE)
    free, usable = figure["layout"]["shapes"]
    assert free["x0"] == free["x1"] == 40.0 and free["line"]["dash"] == "solid"
    assert free["name"] == "free per GPU: 40.0 GiB"
    assert usable["x0"] == pytest.approx(40.0 * float(HEADROOM)) and usable["line"]["dash"] == "dash"
    assert usable["name"].startswith("usable: ")
    cpu = memory_figure([DDP], None, None, FreeMemory(Device.CPU, 8 * GIB, 32 * GIB, "psutil"))
    assert cpu["layout"]["shapes"][0]["name"] == "host RAM per rank: 8.0 GiB"


def test_without_a_free_memory_probe_there_are_no_lines_and_gpu_bytes_are_shown() -> None:
    figure = memory_figure([ZERO3], None, None, None)
    assert figure["layout"]["shapes"] == []
    assert [trace["x"] for trace in figure["data"]] == [[0.0], [1.0], [0.0]]


def test_the_chart_grows_with_the_rows() -> None:
    one = memory_figure([DDP], None, None, None)["layout"]["height"]
    three = memory_figure([DDP, ZERO3, DDP], None, None, None)["layout"]["height"]
    assert three - one == 2 * 22
