"""Kept pools from the kernel's side, without ranks: durations, the records a pool leaves, listing,
finding one, the refusals when another kernel holds it, and stopping one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import psutil
import pytest

from jupyter_shard._util.atomic import write_private
from jupyter_shard.env import RUNTIME_DIR_VAR
from jupyter_shard.errors import PoolError, SpecError
from jupyter_shard.launchers.spec_record import to_record
from jupyter_shard.pool import keep
from jupyter_shard.spec import LaunchSpec


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("90s", 90),
        ("90", 90),
        ("0", 0),
        ("1.5h", 5400),
        ("1d", 86400),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert keep.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "30x", "-5m", "m30"])
def test_a_bad_duration_is_one_line_with_examples(text: str) -> None:
    with pytest.raises(
        SpecError, match=r"give a duration such as 30m, 2h, 1h30m or 90s \(0: end with the kernel\)"
    ):
        keep.parse_duration(text)


def test_durations_are_shown_short() -> None:
    assert [keep.format_duration(s) for s in (5, 125, 3725, -3)] == ["5s", "2m05s", "1h02m", "0s"]


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(tmp_path))
    return tmp_path


@pytest.fixture
def sleeper() -> Iterator[Popen[bytes]]:
    """A process standing in for a rank (or a kernel): it leads its own session, as ranks do."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _record(runtime: Path, name: str, ranks: list[int], owner: int | None, **extra: object) -> Path:
    directory = runtime / f"jupyter_shard-{name}"
    directory.mkdir(mode=0o700)
    started = {pid: psutil.Process(pid).create_time() for pid in [*ranks, *([owner] if owner else [])]}
    record = {
        "created": time.time() - 65,
        "keep": 600.0,
        "notebook": "/home/u/work/train.ipynb",
        "owner": [owner, started[owner]] if owner else None,
        "orphaned_at": time.time() - 60 if owner is None else None,
        "spec": to_record(LaunchSpec.create(nproc=len(ranks), device="cpu")),
        "ranks": [
            {"rank": i, "pid": pid, "started": started[pid], "device": "cpu", "log": "/l"}
            for i, pid in enumerate(ranks)
        ],
        "launcher": "local",
        "launcher_state": {},
        "processes": [[pid, started[pid]] for pid in ranks],
        **extra,
    }
    write_private(directory / "kept.json", json.dumps(record))  # 0600, as the pool writes it
    return directory


def test_listing_shows_live_pools_with_their_time_left(runtime: Path, sleeper: Popen) -> None:
    _record(runtime, "abcd1234", [sleeper.pid], owner=None)
    gone = runtime / "jupyter_shard-gone0000"
    gone.mkdir()
    (gone / "kept.json").write_text(json.dumps({"ranks": [{"rank": 0}], "processes": [[1, 1.0]]}))
    (pool,) = keep.kept_pools()
    assert pool.id == "abcd1234" and pool.owner is None and pool.world_size == 1
    left = pool.time_left()
    assert left is not None and 535 < left < 545
    table = keep.pools_table([pool]).splitlines()
    assert table[0] == "id        ranks  strategy  device  age    time left  kernel  notebook"
    row = table[1].split()
    assert row[:5] + row[6:] == ["abcd1234", "1", "none", "cpu", "1m05s", "none", "train.ipynb"]
    assert row[5] in ("8m59s", "9m00s")  # the lease's time left, to the second
    assert keep.pools_table([]).startswith("no kept pools")


def test_find_says_what_to_name(runtime: Path, sleeper: Popen[bytes]) -> None:
    with pytest.raises(PoolError, match=r"^there is no kept pool on this machine: start one with"):
        keep.find(None)
    _record(runtime, "abcd1234", [sleeper.pid], owner=None)
    _record(runtime, "abce5678", [sleeper.pid], owner=None)
    with pytest.raises(PoolError, match=r"there are 2 kept pools \(abcd1234, abce5678\); name one"):
        keep.find(None)
    with pytest.raises(PoolError, match="more than one kept pool has the id 'abc'"):
        keep.find("abc")
    with pytest.raises(PoolError, match="no kept pool has the id 'zz'"):
        keep.find("zz")
    assert keep.find("abce").id == "abce5678"


def test_a_pool_held_by_a_live_kernel_is_refused_and_stopped_only_by_force(
    runtime: Path, sleeper: Popen[bytes]
) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        directory = _record(runtime, "abcd1234", [sleeper.pid], owner=owner.pid)
        with pytest.raises(
            PoolError,
            match=rf"attached to kernel pid {owner.pid} \(/home/u/work/train.ipynb\); "
            r"%dist_attach abcd1234 --take-over makes it this kernel's",
        ):
            keep.attach("abcd")
        with pytest.raises(
            PoolError, match=f"attached to kernel pid {owner.pid}; stop it there, or use --force"
        ):
            keep.stop("abcd")
        assert keep.stop("abcd", force=True) == "stopped kept pool abcd1234 (1 ranks, none)"
        assert sleeper.wait(5) == -9 and not directory.exists()
    finally:
        owner.kill()
        owner.wait()


def test_this_kernels_own_pool_is_not_attached_again(runtime: Path, sleeper: Popen[bytes]) -> None:
    _record(runtime, "abcd1234", [sleeper.pid], owner=os.getpid())
    with pytest.raises(PoolError, match="pool abcd1234 is this kernel's already"):
        keep.attach()


class _Running:
    """A running pool as let_go sees it: its keep, its spec, and what was done to it."""

    def __init__(self, keep_for: float) -> None:
        self.keep = keep_for
        self.spec = LaunchSpec.create(nproc=2, device="cpu", strategy="ddp")
        self.done: list[str] = []

    def release(self) -> None:
        self.done.append("released")

    def shutdown(self) -> None:
        self.done.append("shut down")


def test_a_replaced_pool_is_released_if_kept_and_stopped_otherwise() -> None:
    said: list[str] = []
    kept, plain = _Running(600.0), _Running(0.0)
    keep.let_go(kept, said.append)  # type: ignore[arg-type]
    keep.let_go(plain, said.append)  # type: ignore[arg-type]
    assert kept.done == ["released"] and plain.done == ["shut down"]
    assert said == [
        "jupyter_shard: letting go of this kernel's kept pool (2 CPU ranks · ddp); %dist_pools lists it",
        "jupyter_shard: stopping this kernel's pool; its rank state is lost",
    ]
