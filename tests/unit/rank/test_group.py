"""jupyter_shard.rank.group: a cell's own init_process_group / destroy_process_group against the pool's
group, in one process (world size 1, gloo on a FileStore)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from jupyter_shard.rank.group import PoolGroup


def _group(device_type: str = "cpu", world_size: int = 2, rank: int = 0) -> PoolGroup:
    return PoolGroup("gloo" if device_type == "cpu" else "nccl", device_type, rank, world_size, 30.0)


@pytest.mark.parametrize(
    ("arguments", "device_type", "expected"),
    [
        ({}, "cpu", ""),
        ({"backend": "gloo", "init_method": "env://", "world_size": 2, "rank": 0}, "cpu", ""),
        ({"backend": "GLOO"}, "cpu", ""),
        ({"backend": "cpu:gloo,cuda:nccl"}, "cpu", ""),
        ({"backend": "cpu:gloo,cuda:nccl"}, "cuda", ""),
        (
            {"backend": "nccl"},
            "cpu",
            'init_process_group(backend="nccl"): this pool\'s ranks run on CPU, where its process group '
            'uses gloo. Pass backend="gloo" or leave backend out, or start the pool with %%distributed '
            "--device cuda",
        ),
        (
            {"backend": "gloo"},
            "cuda",
            'init_process_group(backend="gloo"): this pool\'s ranks run on CUDA GPUs, where its process '
            'group uses nccl. Pass backend="nccl" or leave backend out, or start the pool with %%distributed '
            "--device cpu",
        ),
        (
            {"world_size": 4},
            "cpu",
            "init_process_group(world_size=4): this pool has 2 ranks. Leave world_size out (WORLD_SIZE is "
            "set) or pass 2, or start a pool of 4 with %%distributed --nproc 4",
        ),
        (
            {"rank": 1},
            "cpu",
            "init_process_group(rank=1) on rank 0: the pool numbers its ranks. Leave rank out, or pass "
            'int(os.environ["RANK"])',
        ),
    ],
)
def test_a_call_that_does_not_match_the_pool_says_what_to_change(
    arguments: dict[str, object], device_type: str, expected: str
) -> None:
    assert _group(device_type).mismatch(arguments) == expected


@pytest.fixture
def solo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PoolGroup]:
    """A world of one, with torch.distributed's functions put back afterwards."""
    for module in (dist, dist.distributed_c10d):
        monkeypatch.setattr(module, "init_process_group", dist.distributed_c10d.init_process_group)
        monkeypatch.setattr(module, "destroy_process_group", dist.distributed_c10d.destroy_process_group)
    group = _group(world_size=1)
    group.build_on_file(str(tmp_path / "store"))
    group.install()
    yield group
    if dist.is_initialized():
        dist.destroy_process_group()
    group.free_retired()


def test_a_matching_init_is_accepted_and_a_destroyed_group_is_rebuilt(solo: PoolGroup) -> None:
    rebuilt: list[bool] = []
    solo.on_rebuilt = lambda: rebuilt.append(True)
    world = dist.GroupMember.WORLD
    dist.init_process_group(backend="gloo")  # the pool's group stays
    assert dist.GroupMember.WORLD is world and not rebuilt
    with pytest.raises(ValueError, match="this pool has 1 ranks"):
        dist.init_process_group("gloo", world_size=2)
    assert dist.GroupMember.WORLD is world

    dist.destroy_process_group()
    assert not solo.alive()
    dist.init_process_group("gloo", init_method="env://")  # a script's second run, in the same cell
    assert solo.alive() and rebuilt == [True]
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]


def test_destroyed_groups_are_kept_until_the_next_cell(solo: PoolGroup) -> None:
    world = dist.GroupMember.WORLD
    dist.destroy_process_group()
    assert solo._retired == [world]
    solo.free_retired()
    assert solo._retired == []


def test_a_rebuild_by_the_pool_replaces_a_live_group(solo: PoolGroup, tmp_path: Path) -> None:
    first = dist.GroupMember.WORLD
    solo.build_on_file(str(tmp_path / "store-1"))
    assert solo.alive() and dist.GroupMember.WORLD is not first
