"""jupyter_shard.gpus: CUDA_VISIBLE_DEVICES read as CUDA reads it, GPUs counted without CUDA (WSL2
included), --gpus lists parsed, and the ranks' CUDA_VISIBLE_DEVICES mapped through the kernel's."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.cuda
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jupyter_shard import gpus
from jupyter_shard.gpus import (
    parse_cuda_visible_devices,
    parse_gpu_option,
    physical_gpu_count,
    rank_visible_devices,
    visible_devices,
)
from jupyter_shard.spec import SpecError

# What `nvidia-smi --query-gpu=uuid --format=csv,noheader` prints on a WSL2 machine with two GPUs.
WSL_UUIDS = "GPU-5f1c3a2e-8d4b-11ee-b962-0242ac120002\nGPU-77aa01bc-8d4b-11ee-b962-0242ac120002\n"

CVD_CASES = [
    "0",
    "1,3",
    "0, 1",
    "",
    "-1",
    "0,-1,1",
    "2,",
    "1gpu2,2ampere",
    "0,0",
    "3,1,3",
    "+1,2",
    "GPU-1234abcd,GPU-5678ef00",
    "GPU-1234abcd,0",
    "GPU-aa,GPU-aa",
    "MIG-4b5c6d7e-aaaa-bbbb-cccc-111122223333",
    "nvidia0",
    " 4",
]


@pytest.mark.parametrize("value", CVD_CASES)
def test_cuda_visible_devices_is_read_as_torch_reads_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    expected = [str(d) for d in torch.cuda._parse_visible_devices()]  # torch's own parser, no CUDA needed
    assert parse_cuda_visible_devices(value) == expected


@settings(max_examples=200, database=None)
@given(st.text(alphabet="0123456789,-+ GPUMIa", max_size=14))
def test_any_cuda_visible_devices_value_parses_as_torch_does(value: str) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", value)
        try:
            expected = [str(d) for d in torch.cuda._parse_visible_devices()]
        except ValueError:  # torch's parser fails on a lone sign ("-", "+"), where CUDA sees no number
            expected = None
    assume(expected is not None)
    assert parse_cuda_visible_devices(value) == expected


def test_visible_devices_are_physical_ids(fake_dev: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dev += ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"]
    assert visible_devices() == ("0", "1", "2", "3")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3,1"}) == ("3", "1")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2,9,1"}) == ("2",)  # CUDA stops at a missing device
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == ()
    uuids = "GPU-5f1c3a2e,GPU-77aa01bc"
    assert visible_devices({"CUDA_VISIBLE_DEVICES": uuids}) == ("GPU-5f1c3a2e", "GPU-77aa01bc")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_devices() == ("1",)  # the kernel's own environment by default


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An ``nvidia-smi`` on PATH that prints what the test writes to the yielded file."""
    out = tmp_path / "smi-output"
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "smi-args"}\ncat {out}\n')
    exe.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe) if name == "nvidia-smi" else None)
    gpus._listed_gpus.cache_clear()
    yield out
    gpus._listed_gpus.cache_clear()


def test_wsl2_gpus_are_counted_by_nvidia_smi(fake_dev: list[str], fake_smi: Path) -> None:
    fake_dev += ["dxg", "null", "tty0"]  # WSL2: no /dev/nvidia<N>, the GPU is behind /dev/dxg
    fake_smi.write_text(WSL_UUIDS)
    assert physical_gpu_count() == 2
    assert (fake_smi.parent / "smi-args").read_text().split() == ["--query-gpu=uuid", "--format=csv,noheader"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1"}) == ("1",)


def test_wsl2_without_a_working_nvidia_smi_is_no_gpus(fake_dev: list[str], fake_smi: Path) -> None:
    fake_dev += ["dxg"]
    fake_smi.write_text("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    assert physical_gpu_count() == 0


def test_without_gpu_device_nodes_nvidia_smi_is_not_run(fake_dev: list[str], fake_smi: Path) -> None:
    fake_dev += ["null", "tty0"]
    fake_smi.write_text(WSL_UUIDS)
    assert physical_gpu_count() == 0
    assert not (fake_smi.parent / "smi-args").exists()


def test_this_machine_has_no_gpus() -> None:
    assert physical_gpu_count() == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4, 4),
        ("4", 4),
        ("0,2", (0, 2)),
        ("2,0", (2, 0)),
        ("3,", (3,)),
        ("4-7", (4, 5, 6, 7)),
        ("0, 2-3", (0, 2, 3)),
        ((1, 3), (1, 3)),
        ([5], (5,)),
    ],
)
def test_gpus_option_is_a_count_or_a_device_list(value: object, expected: object) -> None:
    assert parse_gpu_option(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,0", "--gpus 0,0 names device 0 twice; give each device once"),
        ("0-2,1", "--gpus 0-2,1 names device 1 twice; give each device once"),
        ("3-1", "--gpus '3-1': the range 3-1 runs backwards; write it as 1-3"),
        ("-1", "--gpus '-1' is not valid; give a count (--gpus 4) or the devices to use"),
        ("a,b", "--gpus 'a,b' is not valid; give a count"),
        ("", "--gpus '' is not valid"),
        ((0, -2), "--gpus '0,-2' is not valid"),
        (True, "--gpus True is not valid"),
    ],
)
def test_bad_gpus_lists_are_one_clear_line(value: object, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_gpu_option(value)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_a_device_list_is_refused_where_node_agents_place_ranks(launcher: str) -> None:
    assert parse_gpu_option("2", launcher) == 2
    with pytest.raises(SpecError) as err:
        parse_gpu_option("0,2", launcher)
    assert str(err.value) == (
        f"--gpus 0,2 chooses this machine's devices, but --launcher {launcher} places ranks on each "
        "node's own GPUs; give a count (--gpus 2) and set CUDA_VISIBLE_DEVICES on the nodes to choose "
        "devices there"
    )


@pytest.mark.parametrize(
    ("chosen", "kernel", "expected"),
    [
        ((0, 1), None, "0,1"),
        ((0, 2), None, "0,2"),
        ((0, 2), "4,5,6,7", "4,6"),
        ((1,), "3,1", "1"),
        ((2, 0), "4,5,6", "6,4"),
        ((1, 0), "GPU-aaaa,GPU-bbbb", "GPU-bbbb,GPU-aaaa"),
        ((0,), "1gpu,2", "1"),
    ],
)
def test_ranks_get_the_physical_ids_of_the_chosen_devices(
    chosen: tuple[int, ...], kernel: str | None, expected: str
) -> None:
    assert rank_visible_devices(chosen, kernel) == expected


def test_a_device_beyond_the_kernels_list_is_refused() -> None:
    with pytest.raises(SpecError) as err:
        rank_visible_devices((0, 2), "4,5")
    assert str(err.value) == (
        "GPU 2 is not visible: CUDA_VISIBLE_DEVICES=4,5 gives this kernel 2 device(s); "
        "choose from 0-1 with --gpus"
    )
    with pytest.raises(SpecError, match="hides every device"):
        rank_visible_devices((0,), "")
