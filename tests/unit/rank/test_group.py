"""jupyter_shard.rank.group: a cell's own init_process_group / destroy_process_group against the pool's
group, in one process (world size 1, gloo on a FileStore); which way each backend frees a blocked
rank and when a group counts as broken; the NCCL settings every rank starts with."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from jupyter_shard.pool.launches import NCCL_KEEP_RANKS_ALIVE, rank_launch
from jupyter_shard.rank import group as group_module
from jupyter_shard.rank.device import CUDA_BACKEND, device_backends
from jupyter_shard.rank.group import UNKNOWN, PoolGroup, broken_by, collective_failed
from jupyter_shard.spec import LaunchSpec
from jupyter_shard.wire.messages import GROUP_DESTROYED, GROUP_UNKNOWN


def _group(device_type: str = "cpu", world_size: int = 2, rank: int = 0) -> PoolGroup:
    if device_type == "cpu":
        return PoolGroup("gloo", "cpu", rank, world_size, 30.0)
    return PoolGroup(CUDA_BACKEND, "cuda", rank, world_size, 30.0, device_id=torch.device("cuda", rank))


@pytest.mark.parametrize(
    ("arguments", "device_type", "expected"),
    [
        ({}, "cpu", ""),
        ({"backend": "gloo", "init_method": "env://", "world_size": 2, "rank": 0}, "cpu", ""),
        ({"backend": "GLOO"}, "cpu", ""),
        ({"backend": "cpu:gloo,cuda:nccl"}, "cpu", ""),
        ({"backend": "cpu:gloo,cuda:nccl"}, "cuda", ""),
        ({"backend": "nccl"}, "cuda", ""),  # a torchrun script's own: NCCL for its CUDA tensors
        ({"backend": "NCCL", "device_id": torch.device("cuda", 0)}, "cuda", ""),
        ({"backend": "cuda:nccl,cpu:gloo", "device_id": 0}, "cuda", ""),
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
            'group uses nccl (and gloo for CPU tensors: "cpu:gloo,cuda:nccl"). Pass backend="nccl" or leave '
            "backend out, or start the pool with %%distributed --device cpu",
        ),
        (
            {"backend": "cuda:gloo"},
            "cuda",
            'init_process_group(backend="cuda:gloo"): this pool\'s ranks run on CUDA GPUs, where its process '
            'group uses nccl (and gloo for CPU tensors: "cpu:gloo,cuda:nccl"). Pass backend="nccl" or leave '
            "backend out, or start the pool with %%distributed --device cpu",
        ),
        (
            {"backend": "cpu:gloo:nccl"},
            "cpu",
            'init_process_group(backend="cpu:gloo:nccl"): this pool\'s ranks run on CPU, where its process '
            'group uses gloo. Pass backend="gloo" or leave backend out, or start the pool with %%distributed '
            "--device cuda",
        ),
        (
            {"device_id": torch.device("cuda", 1)},
            "cuda",
            "init_process_group(device_id=cuda:1) on rank 0: this rank's GPU is cuda:0. Leave device_id "
            'out, or pass torch.device("cuda", int(os.environ["LOCAL_RANK"]))',
        ),
        (
            {"device_id": 0},
            "cpu",
            "init_process_group(device_id=cuda:0): this pool's ranks run on CPU. Leave device_id out, or "
            "start the pool with %%distributed --device cuda",
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


def test_a_cuda_group_is_device_mapped_and_bound_to_the_rank_gpu() -> None:
    cuda = _group("cuda", rank=1)
    assert cuda.backend == "cpu:gloo,cuda:nccl"
    assert cuda.init_options()["device_id"] == torch.device("cuda", 1)
    assert "device_id" not in _group("cpu").init_options()  # gloo: nothing to bind
    # torch's own reading of the backend string: NCCL for CUDA tensors, gloo for CPU tensors
    assert device_backends(cuda.backend) == dict(BackendConfig(dist.Backend(cuda.backend)).device_backend_map)
    assert device_backends(cuda.backend) == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends("nccl") == {"cuda": "nccl"}


@pytest.mark.parametrize(
    ("backend", "idle", "blocked"),
    [
        ("gloo", ("destroy", "close"), ()),  # today's release: a local abort frees no gloo collective
        ("nccl", ("abort",), ("abort",)),
        ("cpu:gloo,cuda:nccl", ("abort", "close"), ("abort",)),
    ],
)
def test_each_backend_frees_a_blocked_rank_its_own_way(
    backend: str, idle: tuple[str, ...], blocked: tuple[str, ...]
) -> None:
    assert PoolGroup.release_steps(backend, "idle") == idle
    assert PoolGroup.release_steps(backend, "blocked") == blocked


@pytest.mark.parametrize(
    ("error", "handling", "broken"),
    [
        ("SUCCESS", "0", False),
        ("TIMEOUT", "0", False),  # only recorded: the slow collective goes on
        ("TIMEOUT", "2", True),  # the watchdog aborted the communicators
        ("COMM_ERROR", "0", True),
        ("REMOTE_ERROR", "0", True),
    ],
)
def test_a_group_is_broken_by_what_the_watchdog_recorded(error: str, handling: str, broken: bool) -> None:
    assert error in torch._C._distributed_c10d.ErrorType.__members__  # torch's own names
    assert broken_by(error, handling) is broken


def test_an_aborted_group_is_not_alive_and_is_rebuilt(solo: PoolGroup, tmp_path: Path) -> None:
    assert solo.alive()
    aborted: list[bool] = []
    worker = threading.Thread(target=lambda: aborted.append(solo.abort()))  # as the I/O thread does
    worker.start()
    worker.join()
    assert aborted == [True] and not solo.alive() and not dist.is_initialized()
    assert solo.abort() is False  # nothing left to abort
    solo.build_on_file(str(tmp_path / "store-1"))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert solo.alive() and t.item() == 1.0


def test_every_rank_starts_with_the_nccl_settings_that_keep_it_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if header.is_file():  # torch documents each variable it reads there
        declared = header.read_text()
        assert all(f'"{name}"' in declared for name in NCCL_KEEP_RANKS_ALIVE)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the user's own value wins

    def env_of(rank: int) -> dict[str, str]:
        return rank_launch(
            LaunchSpec.create(nproc=2, device="cpu"),
            rank,
            address="ipc:///nowhere",
            key=b"k" * 32,
            lifeline_fd=3,
            master_port=29400,
            curve=None,
            pool_dir=tmp_path,
            log_dir=tmp_path,
        ).env

    for rank in (0, 1):
        env = env_of(rank)
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # a slow collective never ends a rank
        assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert {k: env[k] for k in NCCL_KEEP_RANKS_ALIVE if k != "TORCH_NCCL_DUMP_ON_TIMEOUT"} == {
            k: v for k, v in NCCL_KEEP_RANKS_ALIVE.items() if k != "TORCH_NCCL_DUMP_ON_TIMEOUT"
        }


class _Backend:
    """An NCCL backend as a torch without ``Backend.get_error`` has it (or, with ``error``, with it)."""

    def __init__(self, error: str | None = None) -> None:
        if error is not None:
            self.get_error = lambda: SimpleNamespace(name=error)


def _raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


def _user_error_from(cause: BaseException) -> BaseException:
    def wrap() -> None:
        raise KeyError("step 3 failed") from cause

    return _raised(wrap)


@pytest.fixture
def nccl_group(monkeypatch: pytest.MonkeyPatch) -> Callable[[object], PoolGroup]:
    """A CUDA rank's group whose default group holds ``backend`` for CUDA (no GPU needed)."""

    def make(backend: object) -> PoolGroup:
        def get_backend(device: torch.device) -> object:
            if isinstance(backend, Exception):
                raise backend
            return backend

        default = SimpleNamespace(_get_backend=get_backend)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        return _group("cuda")

    return make


def test_an_nccl_group_whose_health_cannot_be_read_is_rebuilt_after_a_failed_collective(
    nccl_group: Callable[[object], PoolGroup],
) -> None:
    # failures made before the fake is in place: a collective without a group raises inside torch
    in_collective = _raised(lambda: dist.all_reduce(torch.ones(1)))
    from_backend = dist.DistBackendError("NCCL communicator was aborted on rank 0")
    user = _raised(lambda: [][1])
    for backend in (_Backend(), RuntimeError("no backend for cuda")):  # no get_error; no NCCL part
        group = nccl_group(backend)
        assert group._nccl_error() == UNKNOWN
        assert group.alive()  # a cell that succeeded
        assert group.alive(user)  # a Python error of the cell's own
        assert not group.alive(in_collective)
        assert not group.alive(from_backend)
        assert not group.alive(_user_error_from(in_collective))  # raised again by the cell's code
    assert collective_failed(in_collective) and not collective_failed(user)


@pytest.mark.parametrize(("error", "alive"), [("SUCCESS", True), ("TIMEOUT", True), ("COMM_ERROR", False)])
def test_a_readable_nccl_record_decides_whatever_the_cell_raised(
    nccl_group: Callable[[object], PoolGroup], error: str, alive: bool
) -> None:
    in_collective = _raised(lambda: dist.all_reduce(torch.ones(1)))
    group = nccl_group(_Backend(error))
    assert group._nccl_error() == error
    assert group.alive(in_collective) is alive and group.alive() is alive


def test_a_gloo_group_reads_no_environment_and_no_traceback_after_a_cell(
    solo: PoolGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object) -> bool:
        raise AssertionError("read after a gloo cell")

    in_collective = _raised(lambda: dist.all_reduce(torch.ones(1), op="not an op"))  # type: ignore[arg-type]
    monkeypatch.setattr(PoolGroup, "_error_handling", staticmethod(boom))
    monkeypatch.setattr(group_module, "collective_failed", boom)
    assert solo.alive() and solo.alive(in_collective)


def test_a_cell_ending_without_a_group_says_it_was_destroyed(solo: PoolGroup) -> None:
    in_collective = _raised(lambda: dist.all_reduce(torch.ones(1), op="not an op"))
    assert solo.unusable() == "" and solo.unusable(in_collective) == ""
    dist.destroy_process_group()  # the cell's own
    assert solo.unusable() == GROUP_DESTROYED == "DESTROYED"


def test_an_unusable_nccl_group_says_what_nccl_recorded_or_that_it_is_unknown(
    nccl_group: Callable[[object], PoolGroup],
) -> None:
    in_collective = _raised(lambda: dist.all_reduce(torch.ones(1)))
    assert nccl_group(_Backend("REMOTE_ERROR")).unusable() == "REMOTE_ERROR"  # what the watchdog recorded
    assert nccl_group(_Backend("TIMEOUT")).unusable(in_collective) == ""  # only recorded under handling 0
    unreadable = nccl_group(_Backend())
    assert unreadable.unusable(in_collective) == UNKNOWN == GROUP_UNKNOWN and unreadable.unusable() == ""
