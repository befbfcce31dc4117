"""jupyter_shard.planner.estimate: per-rank bytes against the ZeRO formulas, plan rules, recommendations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_shard.planner.estimate import (
    CAVEAT,
    Bytes,
    Plan,
    compare,
    estimate,
    fits,
    format_bytes,
    format_count,
    parse_count,
    plans,
    ranks_needed,
    recommend,
)
from jupyter_shard.planner.free_memory import FreeMemory
from jupyter_shard.spec import Device, Offload, Precision, SpecError

MIXED = (Precision.BF16_MIXED, Precision.FP16_MIXED)
GIB = 2**30
CPU, NVME = Offload.CPU, Offload.NVME


def gpus(per_rank: int, host: int | None = None) -> FreeMemory:
    return FreeMemory(Device.CUDA, per_rank, host, "test")


# -- counts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("124M", 124_000_000),
        ("1.3B", 1_300_000_000),
        ("7e9", 7_000_000_000),
        ("7E9", 7_000_000_000),
        ("350000000", 350_000_000),
        ("350_000_000", 350_000_000),
        ("1,300,000", 1_300_000),
        (" 124 m ", 124_000_000),
        ("2.5K", 2_500),
        ("1.5T", 1_500_000_000_000),
        ("70b", 70_000_000_000),
    ],
)
def test_parse_count(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize(
    "text", ["", "abc", "0", "-5", "0.4", "1.3X", "inf", "nan", "M", "1,3B", "1e999999999"]
)
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(SpecError, match=r"is not valid; write it like 124M, 1.3B, 7e9 or 350000000"):
        parse_count(text)


@pytest.mark.parametrize(
    ("count", "text"), [(124_000_000, "124M"), (1_300_000_000, "1.3B"), (7 * 10**9, "7B"), (999, "999")]
)
def test_format_count(count: int, text: str) -> None:
    assert format_count(count) == text
    assert parse_count(text) == count


def test_format_bytes() -> None:
    assert [format_bytes(b) for b in (12, 3 * 2**10, 512 * 2**20, int(1.86 * GIB))] == [
        "12 B",
        "3.0 KiB",
        "512.0 MiB",
        "1.9 GiB",
    ]


# -- bytes per rank against the formulas ---------------------------------------------------------------

# Ψ divisible by every N below, so the formulas are exact
PSI = [124_000_000 * 24, 1_300_000_000 * 24, 24]
NPROC = [1, 2, 3, 4, 8]


def expected_mixed(plan: Plan, p: int, n: int, per_node: int) -> tuple[int, int, int]:
    """(device, host, disk) bytes per rank for mixed-precision Adam, written out per plan."""
    table = {
        Plan("ddp"): (16 * p, 0, 0),
        Plan("deepspeed", 0): (16 * p, 0, 0),
        # ZeRO-1 and -2: the float32 copy of the gradient partition (4 bytes) beside the master, m and v
        Plan("deepspeed", 1): (4 * p + 16 * p // n, 0, 0),
        Plan("deepspeed", 2): (2 * p + 18 * p // n, 0, 0),
        Plan("deepspeed", 3): (16 * p // n, 0, 0),
        Plan("fsdp", sharding="FULL_SHARD"): (16 * p // n, 0, 0),
        Plan("fsdp", sharding="SHARD_GRAD_OP"): (2 * p + 14 * p // n, 0, 0),
        Plan("fsdp", sharding="NO_SHARD"): (16 * p, 0, 0),
        Plan("fsdp", sharding="HYBRID_SHARD"): (16 * p // per_node, 0, 0),
        Plan("deepspeed", 1, offload=CPU): (4 * p, 16 * p // n, 0),
        Plan("deepspeed", 2, offload=CPU): (2 * p + 2 * p // n, 16 * p // n, 0),
        Plan("deepspeed", 3, offload=CPU): (2 * p // n, 14 * p // n, 0),
        Plan("deepspeed", 3, offload=NVME): (2 * p // n, 0, 14 * p // n),
        Plan("fsdp", offload=CPU): (0, 16 * p // n, 0),
        Plan("fsdp", sharding="SHARD_GRAD_OP", offload=CPU): (2 * p, 14 * p // n, 0),
        Plan("fsdp", sharding="NO_SHARD", offload=CPU): (0, 16 * p, 0),
        Plan("fsdp", sharding="HYBRID_SHARD", offload=CPU): (0, 16 * p // per_node, 0),
    }
    return table[plan]


ALL_PLANS = [
    Plan("ddp"),
    *(Plan("deepspeed", s) for s in range(4)),
    *(Plan("fsdp", sharding=s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")),
    *(Plan("deepspeed", s, offload=CPU) for s in (1, 2, 3)),
    Plan("deepspeed", 3, offload=NVME),
    *(
        Plan("fsdp", sharding=s, offload=CPU)
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    ),
]


@pytest.mark.parametrize("plan", ALL_PLANS, ids=lambda p: p.label)
@pytest.mark.parametrize("precision", MIXED)
def test_mixed_precision_bytes_match_the_formulas(plan: Plan, precision: Precision) -> None:
    for p in PSI:
        for n in NPROC:
            per_node = 1 if n == 1 else n // 2 if n % 2 == 0 else n
            e = estimate(plan, p, n, precision, ranks_per_node=per_node)
            got = (e.device_bytes, e.host_bytes, e.disk_bytes)
            assert got == expected_mixed(plan, p, n, per_node), (plan.label, p, n)
            assert (e.parameters, e.nproc, e.precision) == (p, n, precision)


def test_breakdown_by_component() -> None:
    p, n = 1_300_000_000 * 8, 8
    z2 = estimate(Plan("deepspeed", 2), p, n)
    assert z2.device == Bytes(params=2 * p, grads=2 * p // n + 4 * p // n, optimizer=12 * p // n)
    assert z2.host == z2.disk == Bytes()
    z3 = estimate(Plan("deepspeed", 3, offload=CPU), p, n)
    assert z3.device == Bytes(grads=2 * p // n)
    assert z3.host == Bytes(params=2 * p // n, optimizer=12 * p // n)
    nvme = estimate(Plan("deepspeed", 3, offload=NVME), p, n)
    assert nvme.disk == Bytes(params=2 * p // n, optimizer=12 * p // n)
    fsdp = estimate(Plan("fsdp", offload=CPU), p, n)
    assert fsdp.host == Bytes(2 * p // n, 2 * p // n, 12 * p // n)


@pytest.mark.parametrize("p", [24, 124_000_000 * 6])
@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_fp32_bytes(p: int, n: int) -> None:
    fp32 = Precision.FP32
    assert estimate(Plan("ddp"), p, n, fp32).device == Bytes(4 * p, 4 * p, 8 * p)
    assert estimate(Plan("deepspeed", 1), p, n, fp32).device_bytes == 8 * p + 8 * p // n
    assert estimate(Plan("deepspeed", 2), p, n, fp32).device_bytes == 4 * p + 12 * p // n
    assert estimate(Plan("deepspeed", 3), p, n, fp32).device_bytes == 16 * p // n
    assert estimate(Plan("deepspeed", 3, offload=CPU), p, n, fp32).host == Bytes(4 * p // n, 0, 8 * p // n)


def test_a_shard_is_rounded_up() -> None:
    e = estimate(Plan("deepspeed", 3), 1001, 8)
    assert e.device == Bytes(math.ceil(2 * 1001 / 8), math.ceil(2 * 1001 / 8), math.ceil(12 * 1001 / 8))


@given(st.integers(1, 10**12), st.integers(1, 512), st.sampled_from(ALL_PLANS))
def test_no_plan_holds_more_than_ddp_or_less_than_its_share(p: int, n: int, plan: Plan) -> None:
    e = estimate(plan, p, n)
    everywhere = e.device_bytes + e.host_bytes + e.disk_bytes
    # ZeRO-1 and -2 hold a float32 copy of their gradient partition besides DDP's 16 bytes
    copy = 4 * p / n if plan.strategy == "deepspeed" and plan.zero_stage in (1, 2) else 0
    assert 16 * p / n <= everywhere <= 16 * p + copy


# -- plan rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "none"}, "choose ddp, fsdp or deepspeed"),
        ({"strategy": "ddp", "zero_stage": 2}, "apply only to deepspeed"),
        ({"strategy": "deepspeed", "zero_stage": 4}, "ZeRO stage 4 is not valid"),
        ({"strategy": "fsdp", "sharding": "HALF"}, "choose one of: FULL_SHARD"),
        ({"strategy": "ddp", "offload": CPU}, "offload needs fsdp or deepspeed"),
        ({"strategy": "fsdp", "offload": NVME}, "fsdp offloads to cpu only"),
        ({"strategy": "deepspeed", "zero_stage": 0, "offload": CPU}, "needs ZeRO stage 1, 2 or 3"),
        ({"strategy": "deepspeed", "zero_stage": 2, "offload": NVME}, "needs ZeRO stage 3"),
    ],
)
def test_plans_that_cannot_run_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        Plan(**kwargs)  # type: ignore[arg-type]


def test_plans_fastest_first() -> None:
    assert [p.label for p in plans()] == [
        "DDP",
        "FSDP NO_SHARD",
        "ZeRO-1",
        "ZeRO-2",
        "FSDP SHARD_GRAD_OP",
        "FSDP FULL_SHARD",
        "ZeRO-3",
        "FSDP HYBRID_SHARD",
        "ZeRO-1 + CPU offload",
        "ZeRO-2 + CPU offload",
        "FSDP FULL_SHARD + CPU offload",
        "ZeRO-3 + CPU offload",
        "ZeRO-3 + NVMe offload",
    ]
    # across nodes HYBRID_SHARD (less inter-node traffic) comes before FULL_SHARD
    labels = [p.label for p in plans(multi_node=True)]
    assert labels.index("FSDP HYBRID_SHARD") < labels.index("FSDP FULL_SHARD")


def test_compare_covers_every_plan() -> None:
    rows = compare(1_000_000 * 16, 16, ranks_per_node=8)
    assert [e.plan for e in rows] == plans(multi_node=True)
    hybrid = next(e for e in rows if e.plan.sharding == "HYBRID_SHARD" and e.plan.strategy == "fsdp")
    assert hybrid.device_bytes == 16 * 1_000_000 * 16 // 8


# -- recommending ------------------------------------------------------------------------------------

P = 124_000_000
N = 4


def test_the_brief_example() -> None:
    advice = recommend(compare(P, N), gpus(70 * GIB))
    assert advice.choice is not None and advice.choice.plan == Plan("ddp")
    assert advice.fits is True
    assert advice.reason == "DDP: 124M parameters need 1.8 GiB per rank and fit in 70.0 GiB free; fastest."
    assert advice.text == f"{advice.reason} {CAVEAT}"
    assert "Activations are not included" in CAVEAT and "activation checkpointing reduces them" in CAVEAT
    assert "80%" in CAVEAT


def test_fit_boundary_is_80_percent_exactly() -> None:
    ddp = 16 * P  # 1.984e9 bytes; 80% of 2.48e9
    assert fits(estimate(Plan("ddp"), P, N), gpus(ddp * 5 // 4))
    assert not fits(estimate(Plan("ddp"), P, N), gpus(ddp * 5 // 4 - 1))
    assert recommend(compare(P, N), gpus(ddp * 5 // 4)).choice.plan == Plan("ddp")  # type: ignore[union-attr]
    advice = recommend(compare(P, N), gpus(ddp * 5 // 4 - 1))
    assert advice.choice is not None and advice.choice.plan == Plan("deepspeed", 1)
    assert "the fastest that fits (DDP needs 1.8 GiB per rank)" in advice.reason


@pytest.mark.parametrize(
    ("n", "budget", "label"),
    [
        (N, 4 * P + 16 * P // N, "ZeRO-1"),
        (N, 4 * P + 16 * P // N - 1, "ZeRO-2"),
        (N, 2 * P + 18 * P // N - 1, "FSDP SHARD_GRAD_OP"),
        (N, 2 * P + 14 * P // N - 1, "FSDP FULL_SHARD"),
        (2, 16 * P // 2 - 1, "ZeRO-1 + CPU offload"),  # 4Ψ on the device, less than ZeRO-3's 8Ψ
        (2, 4 * P - 1, "ZeRO-2 + CPU offload"),
        (N, 16 * P // N - 1, "ZeRO-2 + CPU offload"),  # from 4 ranks ZeRO-1 + CPU holds as much as ZeRO-3
        (N, 2 * P + 2 * P // N - 1, "FSDP FULL_SHARD + CPU offload"),
    ],
)
def test_the_fastest_plan_that_fits_is_chosen(n: int, budget: int, label: str) -> None:
    free = gpus(budget * 5 // 4, host=10**15)
    advice = recommend(compare(P, n), free)
    assert advice.choice is not None and advice.choice.plan.label == label
    faster = compare(P, n)[: [e.plan.label for e in compare(P, n)].index(label)]
    assert not any(fits(e, free) for e in faster)


def test_host_ram_limits_cpu_offload() -> None:
    budget = 2 * P // N  # only offload plans fit on the GPUs
    roomy = recommend(compare(P, N), gpus(budget * 5 // 4, host=10**15))
    assert roomy.choice is not None and roomy.choice.plan.label == "FSDP FULL_SHARD + CPU offload"
    # ZeRO-3 + CPU offload keeps 14Ψ/N per rank on the host: N ranks need 14Ψ of host RAM
    tight = recommend(compare(P, N), gpus(budget * 5 // 4, host=(14 * P * 5 // 4) - 1))
    assert tight.choice is not None and tight.choice.plan.label == "ZeRO-3 + NVMe offload"
    assert "(plus 413.9 MiB on NVMe per rank)" in tight.reason


def test_nothing_fits_says_what_would_help() -> None:
    p = 70_000_000_000
    free = gpus(8 * GIB, host=64 * GIB)
    advice = recommend(compare(p, 2), free)
    assert advice.choice is None and advice.fits is False
    assert advice.reason.startswith(
        "Nothing fits with 2 GPUs: at most 80% of 8.0 GiB free per rank and of 64.0 GiB host RAM "
        "may be used, and the leanest plans need more (FSDP FULL_SHARD 521.5 GiB per rank; "
        "FSDP FULL_SHARD + CPU offload 0 B per rank (plus 521.5 GiB of host RAM per rank); "
        "ZeRO-3 + NVMe offload 65.2 GiB per rank (plus 456.3 GiB on NVMe per rank))."
    )
    need = next(n for n in range(1, 10**4) if math.ceil(16 * p / n) * 5 <= 8 * GIB * 4)
    nvme = next(n for n in range(1, 10**4) if math.ceil(2 * p / n) * 5 <= 8 * GIB * 4)
    assert advice.reason.endswith(
        f"More GPUs would help: FSDP FULL_SHARD fits on {need} GPUs; "
        f"ZeRO-3 + NVMe offload fits on {nvme} GPUs."
    )
    assert ranks_needed(Plan("fsdp"), p, Precision.BF16_MIXED, free) == need
    assert ranks_needed(Plan("fsdp", offload=CPU), p, Precision.BF16_MIXED, free) is None


def test_nothing_fits_on_cpu_ranks() -> None:
    advice = recommend(
        compare(7 * 10**9, 2, Precision.FP32), FreeMemory(Device.CPU, 4 * GIB, 8 * GIB, "psutil")
    )
    assert advice.choice is None
    assert "more ranks do not help" in advice.reason


def test_cpu_ranks_count_host_offload_against_the_same_ram() -> None:
    free = FreeMemory(Device.CPU, 16 * P // N * 5 // 4, None, "psutil")
    advice = recommend(compare(P, N, Precision.FP32), free)
    assert advice.choice is not None and advice.choice.plan.label == "FSDP FULL_SHARD"
    assert not fits(estimate(Plan("fsdp", offload=CPU), P, N), FreeMemory(Device.CPU, 16 * P // N, None, "x"))


def test_unknown_free_memory_recommends_the_fastest_and_says_so() -> None:
    advice = recommend(compare(P, N), None)
    assert advice.choice is not None and advice.choice.plan == Plan("ddp")
    assert advice.fits is None
    assert "free memory is unknown" in advice.reason


def test_recommend_needs_estimates() -> None:
    with pytest.raises(ValueError, match="at least one estimate"):
        recommend([], gpus(GIB))
