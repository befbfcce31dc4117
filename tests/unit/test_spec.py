"""jupyter_shard.spec: option resolution, every SpecError, rank lists, GPU counting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_shard import spec
from jupyter_shard.launchers import merge_spec, resolve_spec
from jupyter_shard.launchers.slurm import SlurmOptions
from jupyter_shard.launchers.torchrun import TorchrunOptions
from jupyter_shard.spec import (
    Device,
    LauncherOptions,
    LaunchSpec,
    Offload,
    Precision,
    SpecError,
    Strategy,
    format_ranks,
    parse_ranks,
    visible_gpus,
)

# -- LaunchSpec.create: resolution -------------------------------------------------------------------


def test_auto_device_without_gpus_is_cpu_with_two_ranks() -> None:
    s = LaunchSpec.create(gpu_count=0)
    assert s.device is Device.CPU
    assert s.nproc == 2
    assert s.strategy == "none"
    assert s.offload is Offload.NONE
    assert s.precision is Precision.FP32
    assert s.config is None
    assert s.describe() == "2 CPU ranks · none"


def test_auto_device_with_gpus_is_cuda_with_one_rank_per_gpu() -> None:
    s = LaunchSpec.create(gpu_count=4)
    assert s.device is Device.CUDA
    assert s.nproc == 4
    assert s.describe() == "4 GPU ranks (GPUs 0-3) · none"


def test_explicit_cpu_with_gpus_present_keeps_default_two_ranks() -> None:
    s = LaunchSpec.create(device="cpu", gpu_count=8)
    assert (s.device, s.nproc) == (Device.CPU, 2)


def test_gpus_option_sets_cuda_and_rank_count() -> None:
    s = LaunchSpec.create(gpus=2, gpu_count=4, strategy="ddp")
    assert (s.device, s.nproc, s.strategy) == (Device.CUDA, 2, Strategy.DDP)
    assert s.describe() == "2 GPU ranks (GPUs 0-1) · ddp"


def test_gpus_equal_to_nproc_is_accepted() -> None:
    assert LaunchSpec.create(gpus=2, nproc=2, gpu_count=2).nproc == 2


def test_explicit_nproc_on_cpu() -> None:
    s = LaunchSpec.create(nproc=1, gpu_count=0)
    assert s.nproc == 1
    assert s.describe() == "1 CPU rank · none"


def test_enum_members_are_accepted_as_well_as_strings() -> None:
    s = LaunchSpec.create(
        device=Device.CPU,
        strategy=Strategy.DEEPSPEED,
        zero_stage=3,
        offload=Offload.NVME,
        precision=Precision.BF16_MIXED,
        gpu_count=0,
    )
    assert s.strategy == "deepspeed" and s.zero_stage == 3
    assert s.offload is Offload.NVME and s.precision is Precision.BF16_MIXED
    s2 = LaunchSpec.create(precision="16-mixed", offload="cpu", gpu_count=0)
    assert s2.precision is Precision.FP16_MIXED and s2.offload is Offload.CPU


def test_uses_visible_gpus_when_gpu_count_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec, "visible_gpus", lambda: 3)
    s = LaunchSpec.create()
    assert (s.device, s.nproc) == (Device.CUDA, 3)
    monkeypatch.setattr(spec, "visible_gpus", lambda: 0)
    s = LaunchSpec.create()
    assert (s.device, s.nproc) == (Device.CPU, 2)


def test_existing_config_file_is_kept(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    s = LaunchSpec.create(config=str(cfg), strategy="deepspeed", zero_stage=2, gpu_count=0)
    assert s.config == cfg


def test_specs_compare_by_every_field() -> None:
    a = LaunchSpec.create(gpu_count=0)
    b = LaunchSpec.create(gpu_count=0, strategy="ddp", timeout=5)
    c = LaunchSpec.create(gpu_count=0, nproc=3)
    assert a != b
    assert a != c
    assert a.with_changes(nproc=3) == c


def test_spec_is_frozen() -> None:
    s = LaunchSpec.create(gpu_count=0)
    with pytest.raises(AttributeError):
        s.nproc = 5  # type: ignore[misc]


# -- LaunchSpec.create: every SpecError -------------------------------------------------------------


def _err(**kwargs: object) -> str:
    kwargs.setdefault("gpu_count", 0)
    with pytest.raises(SpecError) as info:
        resolve_spec(**kwargs)  # LaunchSpec.create, with the launchers' own options
    msg = str(info.value)
    assert "\n" not in msg, "a SpecError is one line"
    return msg


def _opt(s: LaunchSpec, name: str) -> object:
    """One of the launcher's own options of ``s``."""
    return dict(s.launcher_options.items())[name]


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


@pytest.mark.parametrize("n", [0, -1])
def test_nproc_below_one(n: int) -> None:
    assert _err(nproc=n) == f"--nproc {n} is not valid; a pool needs at least 1 rank"


def test_gpus_without_gpus_suggests_cpu_ranks() -> None:
    msg = _err(gpus=4)
    assert "--gpus 4" in msg
    assert "0 CUDA device(s) are visible" in msg
    assert "`--nproc 4 --device cpu`" in msg


def test_gpus_more_than_visible() -> None:
    msg = _err(gpus=8, gpu_count=4)
    assert "--gpus 8 asked for, but 4 CUDA device(s) are visible" in msg


def test_gpus_zero() -> None:
    assert _err(gpus=0, gpu_count=4) == "--gpus 0 is not valid; use 1 or more"


def test_gpus_with_device_cpu() -> None:
    msg = _err(gpus=2, device="cpu", gpu_count=4)
    assert msg == "--gpus 2 needs CUDA but --device is cpu; use --nproc 2"


def test_gpus_and_nproc_disagree() -> None:
    msg = _err(gpus=2, nproc=3, gpu_count=4)
    assert msg == "--gpus 2 and --nproc 3 disagree; give only one of them"


def test_strategy_bogus_lists_the_allowed_ones() -> None:
    msg = _err(strategy="bogus")
    assert msg == "--strategy 'bogus' is not valid; choose one of: none, ddp, fsdp, deepspeed"


def test_device_bogus() -> None:
    assert _err(device="tpu") == "--device 'tpu' is not valid; choose one of: auto, cpu, cuda"


def test_offload_and_precision_bogus() -> None:
    assert _err(offload="disk") == "--offload 'disk' is not valid; choose one of: none, cpu, nvme"
    msg = _err(precision="fp8")
    assert msg == "--precision 'fp8' is not valid; choose one of: 32, bf16-mixed, 16-mixed"


@pytest.mark.parametrize("stage", [-1, 4, 99])
def test_zero_stage_out_of_range(stage: int) -> None:
    assert _err(strategy="deepspeed", zero_stage=stage) == (
        f"--zero-stage {stage} is not valid; choose 0, 1, 2 or 3"
    )


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp"])
def test_zero_stage_without_deepspeed(strategy: str) -> None:
    assert _err(strategy=strategy, zero_stage=2) == "--zero-stage applies only to --strategy deepspeed"


def test_zero_stage_zero_is_not_mistaken_for_unset() -> None:
    assert _err(strategy="ddp", zero_stage=0) == "--zero-stage applies only to --strategy deepspeed"


def test_device_cuda_without_gpus() -> None:
    msg = _err(device="cuda")
    assert msg.startswith("--device cuda asked for, but no CUDA device is visible")
    assert "--device cpu" in msg


def test_nproc_more_than_gpus_on_cuda() -> None:
    msg = _err(nproc=8, device="cuda", gpu_count=4)
    assert msg == "--nproc 8 CUDA ranks need 8 GPUs but 4 are visible; use --nproc 4 or --device cpu"


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    msg = _err(config=str(missing))
    assert msg == f"--config {str(missing)!r} does not exist; give a path to a JSON file"


def test_config_that_is_a_directory(tmp_path: Path) -> None:
    assert "does not exist" in _err(config=tmp_path)


@pytest.mark.parametrize("timeout", [0, -1, -0.5])
def test_timeout_not_positive(timeout: float) -> None:
    assert _err(timeout=timeout) == f"--collective-timeout {timeout:g} is not valid; give seconds above 0"


def test_timeout_nan_is_rejected() -> None:
    assert "--collective-timeout nan is not valid" in _err(timeout=float("nan"))


def test_nodes_below_one_on_cpu() -> None:
    assert _err(nodes=0) == "--nodes 0 is not valid; use 1 or more"


def test_nodes_below_one_on_cuda_names_nodes() -> None:
    assert _err(nodes=0, gpu_count=4) == "--nodes 0 is not valid; use 1 or more"


def test_constructor_refuses_unresolved_auto() -> None:
    with pytest.raises(SpecError, match=r"resolve device 'auto' with LaunchSpec\.create"):
        LaunchSpec(device=Device.AUTO)


# -- parse_ranks / format_ranks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", (0,)),
        ("0,2", (0, 2)),
        ("1-3", (1, 2, 3)),
        (" 1 - 3", (1, 2, 3)),
        ("0, 2", (0, 2)),
        ("2,0", (0, 2)),
        ("2,2,0,2", (0, 2)),
        ("1-3,2-4", (1, 2, 3, 4)),
        ("3-3", (3,)),
        ("0-1,5", (0, 1, 5)),
    ],
)
def test_parse_ranks(text: str, expected: tuple[int, ...]) -> None:
    assert parse_ranks(text) == expected


@pytest.mark.parametrize("text", ["", ",", "a", "-1", "1-", "-", "0,,2", "1-2-3", "1.5", "0;1", "0x1"])
def test_parse_ranks_rejects_malformed(text: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_ranks(text)
    assert str(info.value) == f"rank list {text!r} is not valid; write ranks like 0, 0,2 or 1-3"


def test_parse_ranks_backwards_range() -> None:
    with pytest.raises(SpecError) as info:
        parse_ranks("3-1")
    assert str(info.value) == "rank range '3-1' runs backwards; write it as 1-3"


def test_parse_ranks_out_of_range_names_rank_and_valid_range() -> None:
    with pytest.raises(SpecError) as info:
        parse_ranks("7", world_size=2)
    assert str(info.value) == "rank 7 does not exist: the pool has 2 ranks (0-1)"


def test_parse_ranks_out_of_range_names_the_lowest_missing_rank() -> None:
    with pytest.raises(SpecError, match=r"^rank 4 does not exist: the pool has 4 ranks \(0-3\)$"):
        parse_ranks("0,9,4-5", world_size=4)


def test_parse_ranks_inside_world_size() -> None:
    assert parse_ranks("0-3", world_size=4) == (0, 1, 2, 3)


def test_parse_ranks_huge_range_is_refused_without_enumerating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_range = range

    def guarded_range(*args: int) -> range:
        r = real_range(*args)
        if len(r) > 1_000_000:
            raise AssertionError(f"parse_ranks enumerated {len(r)} ranks")
        return r

    monkeypatch.setattr(spec, "range", guarded_range, raising=False)
    with pytest.raises(SpecError, match="does not exist"):
        parse_ranks("0-10000000000", world_size=2)


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([], ""), ([3], "3"), ([0, 1, 2, 5], "0-2,5"), ([5, 0, 2, 1, 1], "0-2,5"), ([0, 2, 4], "0,2,4")],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


@settings(max_examples=60, database=None)
@given(st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=40))
def test_format_then_parse_round_trips(ranks: list[int]) -> None:
    assert parse_ranks(format_ranks(ranks)) == tuple(sorted(set(ranks)))


@settings(max_examples=60, database=None)
@given(st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=40))
def test_parse_then_format_is_canonical(ranks: list[int]) -> None:
    text = ",".join(map(str, ranks))
    assert format_ranks(parse_ranks(text)) == format_ranks(ranks)


# -- visible_gpus -----------------------------------------------------------------------------------------


def test_visible_gpus_counts_nvidia_device_nodes(fake_dev: list[str]) -> None:
    fake_dev += ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null", "nvme0"]
    assert visible_gpus() == 2


def test_visible_gpus_without_devices(fake_dev: list[str]) -> None:
    fake_dev += ["null", "tty0"]
    assert visible_gpus() == 0


def test_visible_gpus_unreadable_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: str = ".") -> list[str]:
        raise PermissionError(path)

    monkeypatch.setattr(os, "listdir", broken)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == 0


@pytest.mark.parametrize(
    ("cvd", "expected"),
    [("0", 1), ("1,3", 2), ("0, 1", 2), ("", 0), ("-1", 0), ("GPU-1234abcd,GPU-5678ef00", 2), ("2,", 1)],
)
def test_visible_gpus_honours_cuda_visible_devices(
    fake_dev: list[str], monkeypatch: pytest.MonkeyPatch, cvd: str, expected: int
) -> None:
    fake_dev += ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert visible_gpus() == expected


def test_cuda_visible_devices_without_any_gpu_is_zero(
    fake_dev: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_gpus() == 0


def test_cuda_visible_devices_stops_at_invalid_index(
    fake_dev: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_dev += ["nvidia0", "nvidia1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert visible_gpus() == 1


def test_strategy_registered_in_this_process_is_accepted() -> None:
    from jupyter_shard.strategies import _registered, register_strategy
    from jupyter_shard.strategies.base import NoStrategy

    with pytest.raises(SpecError, match=r"choose one of: none, ddp, fsdp, deepspeed"):
        LaunchSpec.create(strategy="mine", gpu_count=0)
    register_strategy("mine", NoStrategy)
    try:
        assert LaunchSpec.create(strategy="mine", gpu_count=0).strategy == "mine"
        with pytest.raises(SpecError, match=r"choose one of: none, ddp, fsdp, deepspeed, mine"):
            LaunchSpec.create(strategy="theirs", gpu_count=0)
    finally:
        _registered.pop("mine")


# -- multi-node options: --nodes, --hosts, --interface, SLURM's --partition/--time/--account -------------


def test_several_nodes_need_torchrun_or_slurm() -> None:
    msg = _err(nodes=2)
    assert msg.startswith("--nodes 2 needs --launcher torchrun or slurm")
    for launcher in ("torchrun", "slurm"):
        s = resolve_spec(nodes=2, launcher=launcher, gpu_count=0)
        assert (s.nodes, s.launcher) == (2, launcher)


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_hosts_only_with_torchrun(launcher: str) -> None:
    assert _err(hosts="a,b", launcher=launcher) == (
        "--hosts applies only to --launcher torchrun (one host per node)"
    )


@pytest.mark.parametrize("nodes", [1, 3])
def test_hosts_give_the_node_count(nodes: int) -> None:
    s = resolve_spec(launcher="torchrun", hosts="a,b,c", nodes=nodes, gpu_count=0)
    assert s.nodes == 3
    assert _opt(s, "hosts") == ("a", "b", "c")


def test_hosts_as_a_list_with_spaces_around_names() -> None:
    s = resolve_spec(launcher="torchrun", hosts=[" a", "b "], gpu_count=0)
    assert (_opt(s, "hosts"), s.nodes) == (("a", "b"), 2)
    assert _opt(resolve_spec(launcher="torchrun", hosts="a, b", gpu_count=0), "hosts") == ("a", "b")


@pytest.mark.parametrize("nodes", [2, 4])
def test_hosts_disagreeing_with_nodes_are_refused(nodes: int) -> None:
    msg = _err(launcher="torchrun", hosts="a,b,c", nodes=nodes)
    assert msg == f"--hosts names 3 host(s) but --nodes is {nodes}; give one host per node"


def test_constructor_refuses_hosts_that_disagree_with_nodes() -> None:
    with pytest.raises(SpecError, match=r"--hosts names 2 host\(s\) but --nodes is 3"):
        LaunchSpec(launcher="torchrun", launcher_options=TorchrunOptions(hosts=("a", "b")), nodes=3)


@pytest.mark.parametrize(
    "hosts", ["", ",", "a,,b", "a,", "-oProxyCommand=touch /tmp/x", "a,-b", "a b", "a,b\tc", "a\nb", []]
)
def test_bad_hosts_are_refused(hosts: object) -> None:
    msg = _err(launcher="torchrun", hosts=hosts)
    assert msg.startswith("--hosts ") and msg.endswith("is not valid; give host names like node1,node2")


@pytest.mark.parametrize(
    ("option", "flag", "value"),
    [("partition", "--partition", "gpu"), ("time_limit", "--time", "1:00:00"), ("account", "--account", "p")],
)
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_slurm_options_only_with_slurm(option: str, flag: str, value: str, launcher: str) -> None:
    assert _err(launcher=launcher, **{option: value}) == f"{flag} applies only to --launcher slurm"
    s = resolve_spec(launcher="slurm", gpu_count=0, **{option: value})
    assert _opt(s, option) == value


def test_slurm_options_are_kept() -> None:
    s = resolve_spec(launcher="slurm", nodes=2, partition="gpu", time_limit="30", account="proj", gpu_count=0)
    assert s.launcher_options == SlurmOptions(partition="gpu", time_limit="30", account="proj")
    assert s.nodes == 2


def test_interface_refused_for_the_local_launcher() -> None:
    msg = _err(interface="eth0")
    assert msg == "--interface applies only to --launcher torchrun or slurm (remote ranks)"
    assert "--interface" in _err(interface="")


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_interface_kept_for_remote_launchers(launcher: str) -> None:
    assert _opt(resolve_spec(launcher=launcher, interface="eth0", gpu_count=0), "interface") == "eth0"


def test_world_size_is_ranks_per_node_times_nodes() -> None:
    assert resolve_spec(nproc=3, gpu_count=0).world_size == 3
    assert resolve_spec(nproc=3, nodes=2, launcher="torchrun", gpu_count=0).world_size == 6
    assert resolve_spec(gpus=4, nodes=3, launcher="slurm", gpu_count=0).world_size == 12


def test_multi_node_means_a_remote_launcher() -> None:
    assert not resolve_spec(gpu_count=0).multi_node
    assert resolve_spec(launcher="torchrun", gpu_count=0).multi_node
    assert resolve_spec(launcher="slurm", gpu_count=0).multi_node


def test_describe_local_and_multi_node() -> None:
    assert resolve_spec(nproc=1, gpu_count=0).describe() == "1 CPU rank · none"
    s = resolve_spec(nproc=3, launcher="torchrun", hosts="a,b", strategy="ddp", gpu_count=0)
    assert s.describe() == "2 nodes × 3 CPU ranks (torchrun) · ddp"
    s = resolve_spec(gpus=1, launcher="slurm", gpu_count=0)
    assert s.describe() == "1 node × 1 GPU rank (slurm) · none"


def test_every_multi_node_option_makes_another_spec() -> None:
    base = resolve_spec(launcher="torchrun", hosts="a,b", interface="eth0", gpu_count=0)
    specs = {
        base,
        base.with_changes(launcher_options=TorchrunOptions(("a", "c"), "eth0")),
        base.with_changes(launcher_options=TorchrunOptions(("a", "b"), "eth1")),
        base.with_changes(nodes=3, launcher_options=TorchrunOptions(("a", "b", "c"), "eth0")),
        base.with_changes(launcher="slurm", launcher_options=SlurmOptions(partition="gpu")),
        base.with_changes(launcher="slurm", launcher_options=SlurmOptions(partition="cpu")),
        base.with_changes(launcher="slurm", launcher_options=SlurmOptions(time_limit="10")),
        base.with_changes(launcher="slurm", launcher_options=SlurmOptions(account="x")),
    }
    assert len(specs) == 8


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_gpus_on_remote_nodes_are_not_counted_here(launcher: str) -> None:
    s = resolve_spec(gpus=4, launcher=launcher, gpu_count=0)
    assert (s.device, s.nproc) == (Device.CUDA, 4)
    s = resolve_spec(nproc=4, device="cuda", launcher=launcher, gpu_count=0)
    assert (s.device, s.nproc) == (Device.CUDA, 4)
    assert "--gpus 4 asked for, but 0 CUDA device(s) are visible" in _err(gpus=4)
    assert "--nproc 4 CUDA ranks need 4 GPUs" in _err(nproc=4, device="cuda", gpu_count=2)


def test_gpus_on_remote_nodes_still_need_cuda() -> None:
    assert "needs CUDA but --device is cpu" in _err(gpus=4, device="cpu", launcher="torchrun")


# -- LaunchSpec.merged: the one rule for options across cells -----------------------------------------


def _every_field_set(tmp_path: Path) -> LaunchSpec:
    cfg = tmp_path / "ds.json"
    cfg.write_text("{}")
    s = resolve_spec(
        nproc=3,
        device="cpu",
        strategy="deepspeed",
        zero_stage=2,
        offload="cpu",
        precision="bf16-mixed",
        launcher="torchrun",
        hosts="a,b",
        interface="eth0",
        timeout=7.0,
        config=cfg,
        accumulate=4,
        clip_grad_norm=1.5,
        gpu_count=0,
    )
    return s.with_changes(env=(("A", "1"),))


def test_merged_with_nothing_keeps_every_field(tmp_path: Path) -> None:
    base = _every_field_set(tmp_path)
    assert base.merged({}) == base
    assert base.merged({"accumulate": 4}) == base  # naming the current value changes nothing


@pytest.mark.parametrize(
    ("option", "value", "field_value"),
    [
        ("nproc", 5, 5),
        ("strategy", "fsdp", "fsdp"),
        ("zero_stage", 3, 3),
        ("offload", "none", Offload.NONE),
        ("precision", "16-mixed", Precision.FP16_MIXED),
        ("timeout", 9.0, 9.0),
        ("accumulate", 2, 2),
        ("clip_grad_norm", 0.5, 0.5),
    ],
)
def test_merged_changes_only_the_named_option(
    tmp_path: Path, option: str, value: object, field_value: object
) -> None:
    base = _every_field_set(tmp_path)
    new = base.merged({option: value})
    assert getattr(new, option) == field_value
    kept = {f for f in LaunchSpec.__dataclass_fields__ if f != option}
    if option == "strategy":
        kept.discard("zero_stage")  # a zero stage belongs to deepspeed only
        assert new.zero_stage is None
    assert {f: getattr(new, f) for f in kept} == {f: getattr(base, f) for f in kept}


@pytest.mark.parametrize(
    ("option", "value", "field_value"), [("interface", "eth1", "eth1"), ("hosts", "c,d", ("c", "d"))]
)
def test_merging_changes_only_the_named_launcher_option(
    tmp_path: Path, option: str, value: object, field_value: object
) -> None:
    base = _every_field_set(tmp_path)
    new = merge_spec(base, {option: value})
    assert _opt(new, option) == field_value
    assert new.with_changes(launcher_options=base.launcher_options) == base
    others = {k: v for k, v in base.launcher_options.items() if k != option}
    assert {k: v for k, v in new.launcher_options.items() if k != option} == others


def test_merge_spec_without_launcher_options_is_merged(tmp_path: Path) -> None:
    base = _every_field_set(tmp_path)
    assert merge_spec(base, {}) == base
    assert merge_spec(base, {"accumulate": 2}) == base.merged({"accumulate": 2})


def test_merged_covers_every_field() -> None:
    fields = set(LaunchSpec.__dataclass_fields__)
    assert fields == {*spec._KEPT_FIELDS, "env"}


def test_merged_keeps_training_options_when_only_the_rank_count_changes() -> None:
    base = resolve_spec(
        nproc=2, strategy="ddp", precision="bf16-mixed", accumulate=4, clip_grad_norm=1.0, gpu_count=0
    )
    new = base.merged({"nproc": 3})
    assert (new.nproc, new.strategy, new.precision) == (3, "ddp", Precision.BF16_MIXED)
    assert (new.accumulate, new.clip_grad_norm) == (4, 1.0)


def test_merged_starts_another_launcher_from_its_defaults() -> None:
    base = resolve_spec(launcher="torchrun", hosts="a,b", interface="eth0", gpu_count=0)
    new = merge_spec(base, {"launcher": "slurm"})
    assert (new.launcher, new.launcher_options, new.nodes) == ("slurm", SlurmOptions(), 1)
    assert base.merged({"launcher": "slurm"}).launcher_options == LauncherOptions()


def test_merged_refuses_what_is_not_an_option() -> None:
    with pytest.raises(SpecError, match="'ranks' is not a pool option"):
        resolve_spec(gpu_count=0).merged({"ranks": "0"})


# -- --gpus as a device list ------------------------------------------------------------------------------


def test_gpus_list_chooses_those_devices() -> None:
    s = LaunchSpec.create(gpus="0,2", gpu_count=4, strategy="ddp")
    assert (s.device, s.nproc, s.gpus, s.devices) == (Device.CUDA, 2, (0, 2), (0, 2))
    assert s.describe() == "2 GPU ranks (GPUs 0,2) · ddp"
    one = LaunchSpec.create(gpus="3,", gpu_count=4)
    assert (one.nproc, one.devices, one.describe()) == (1, (3,), "1 GPU rank (GPU 3) · none")
    assert LaunchSpec.create(gpus=(1, 3), gpu_count=4) == LaunchSpec.create(gpus="1,3", gpu_count=4)
    assert LaunchSpec.create(gpus="0-2", gpu_count=4) == LaunchSpec.create(gpus=3, gpu_count=4)  # the default
    assert LaunchSpec.create(gpus="1,0", gpu_count=4).gpus == (1, 0)


def test_a_count_uses_the_first_visible_devices() -> None:
    s = LaunchSpec.create(gpus="2", gpu_count=4)
    assert (s.gpus, s.devices) == (None, (0, 1))
    assert LaunchSpec.create(gpu_count=0).devices == ()


@pytest.mark.parametrize(
    ("kernel", "gpus", "expected"),
    [
        (None, "0,2", "0,2"),
        ("4,5,6,7", "0,2", "4,6"),
        ("4,5,6,7", "2", "4,5"),
        ("GPU-a,GPU-b", "1,", "GPU-b"),
    ],
)
def test_local_ranks_see_the_chosen_devices_by_physical_id(
    kernel: str | None, gpus: str, expected: str
) -> None:
    s = LaunchSpec.create(gpus=gpus, gpu_count=4)
    assert s.rank_visible_devices(kernel) == expected


def test_cpu_and_agent_placed_ranks_keep_their_inherited_devices() -> None:
    assert LaunchSpec.create(nproc=2, device="cpu", gpu_count=4).rank_visible_devices("0,1") is None
    remote = resolve_spec(launcher="torchrun", hosts="a,b", gpus=2, gpu_count=0)
    assert (remote.devices, remote.rank_visible_devices(None)) == ((), None)
    assert remote.describe() == "2 nodes × 2 GPU ranks (torchrun) · none"


def test_gpus_list_naming_a_hidden_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _err(gpus="0,5", gpu_count=4) == (
        "--gpus 0,5: GPU 5 is not visible; this kernel sees 4 GPU(s), numbered 0-3; "
        "choose among them (--gpus 0-1)"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _err(gpus="2,", gpu_count=2) == (
        "--gpus 2,: GPU 2 is not visible; this kernel sees 2 GPU(s), numbered 0-1 "
        "(CUDA_VISIBLE_DEVICES=2,3 numbers them from 0); choose among them (--gpus 0,)"
    )


def test_gpus_list_errors_name_the_list() -> None:
    assert _err(gpus="0,2") == (
        "--gpus 0,2 asked for, but 0 CUDA device(s) are visible; run `--nproc 2 --device cpu` for CPU ranks"
    )
    assert (
        _err(gpus="0,2", nproc=3, gpu_count=4) == "--gpus 0,2 and --nproc 3 disagree; give only one of them"
    )
    assert _err(gpus="0,2", device="cpu", gpu_count=4) == (
        "--gpus 0,2 needs CUDA but --device is cpu; use --nproc 2"
    )
    assert _err(gpus="1,1", gpu_count=4) == "--gpus 1,1 names device 1 twice; give each device once"
    assert "--gpus 'x' is not valid; give a count (--gpus 4)" in _err(gpus="x", gpu_count=4)


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_gpus_list_is_refused_by_launchers_whose_agents_place_ranks(launcher: str) -> None:
    msg = _err(gpus="0,2", launcher=launcher, nodes=2)
    assert msg.startswith(f"--gpus 0,2 chooses this machine's devices, but --launcher {launcher}")
    assert "give a count (--gpus 2)" in msg


def test_a_spec_refuses_devices_that_do_not_fit_its_ranks() -> None:
    base = LaunchSpec.create(gpus="0,2", gpu_count=4)
    for bad in ({"nproc": 3}, {"gpus": (0, 0)}, {"device": Device.CPU}):
        with pytest.raises(SpecError, match="give one distinct device per CUDA rank"):
            base.with_changes(**bad)


def test_merged_keeps_a_device_list_until_the_devices_are_named_anew() -> None:
    base = LaunchSpec.create(gpus="0,2", gpu_count=4, strategy="ddp")
    assert base.merged({"strategy": "fsdp", "gpu_count": 4}).gpus == (0, 2)
    assert base.merged({"gpus": "1,3", "gpu_count": 4}).gpus == (1, 3)
    assert base.merged({"gpus": 3, "gpu_count": 4}).devices == (0, 1, 2)
    again = base.merged({"nproc": 2, "gpu_count": 4})
    assert (again.gpus, again.devices) == (None, (0, 1))
    assert base.merged({"device": "cpu"}).devices == ()
    assert merge_spec(base, {"launcher": "torchrun", "nodes": 2, "gpu_count": 4}).gpus is None


def test_visible_gpus_on_wsl2_without_nvidia_device_nodes(
    fake_dev: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from jupyter_shard import gpus

    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho GPU-5f1c3a2e-8d4b-11ee-b962-0242ac120002\n")
    exe.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe) if name == "nvidia-smi" else None)
    gpus._listed_gpus.cache_clear()
    fake_dev += ["dxg"]
    try:
        assert visible_gpus() == 1
    finally:
        gpus._listed_gpus.cache_clear()


def test_merge_spec_gives_the_last_merge_again_only_for_the_same_spec_and_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import jupyter_shard.launchers as launchers

    base = resolve_spec(nproc=2, device="cpu")
    first = merge_spec(base, {"nproc": 3})
    calls: list[object] = []
    real = launchers._merge
    monkeypatch.setattr(launchers, "_merge", lambda s, c: calls.append(c) or real(s, c))
    assert merge_spec(base, {"nproc": 3}) is first and calls == [], "the same line on the same pool"
    assert merge_spec(base, {"nproc": 4}).nproc == 4 and len(calls) == 1
    again = resolve_spec(nproc=2, device="cpu")  # equal, but another spec: merged anew
    assert merge_spec(again, {"nproc": 4}).nproc == 4 and len(calls) == 2
    assert merge_spec(again, {"nproc": 4, "strategy": "ddp"}).strategy == "ddp" and len(calls) == 3
