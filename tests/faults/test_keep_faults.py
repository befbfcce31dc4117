"""F21: a kept pool whose kernel is killed (before or while attaching), whose lease runs out, or that
is asked for after its lease ran out. Nothing already kept is lost while the lease lasts, the errors
are one line, and at lease end no process, socket or directory is left. Without ``--keep`` the ranks
still end with their kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_shard import PoolError
from jupyter_shard.env import RUNTIME_DIR_VAR
from jupyter_shard.pool.keep import attach, kept_pools
from tests.faults.conftest import alive, wait_gone

pytestmark = pytest.mark.timeout(180)

# A driving process that keeps its pool for KEEP seconds, gives it state, says where, and is killed.
DRIVER = """
import json, os, signal, sys
from jupyter_shard import Pool
pool = Pool(nproc=int(sys.argv[1]), device="cpu", strategy="ddp", keep=float(sys.argv[2]))
pool.start()
pool.run("import torch, torch.distributed as dist\\nkept = 41")
print(json.dumps({"pids": [r.handle.pid for r in pool.ranks], "dir": str(pool.directory)}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
# An attaching process killed half-way: after binding the pool's socket, before it is done.
ATTACH_KILLED = """
import os, signal
import jupyter_shard.pool.keep as keep
def killed(pool):
    os.kill(os.getpid(), signal.SIGKILL)
keep._restore_history = killed
keep.attach()
"""


@pytest.fixture
def runtime(kept_runtime: Path) -> Path:
    return kept_runtime


def _killed_driver(nproc: int, keep: float) -> tuple[list[int], Path]:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(nproc), str(keep)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, done.stderr[-2000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    return started["pids"], Path(started["dir"])


@pytest.mark.parametrize("nproc", [2, 3])
def test_f21_the_lease_running_out_leaves_no_process_socket_or_directory(nproc: int, runtime: Path) -> None:
    pids, directory = _killed_driver(nproc, keep=2.0)
    assert alive(pids) == pids and (directory / "pool.sock").exists() and (directory / "kept.json").exists()
    assert oct((directory / "kept.json").stat().st_mode & 0o777) == "0o600"  # it holds the key
    wait_gone(pids, within=6.0)
    assert not directory.exists()
    with pytest.raises(PoolError, match=r"^there is no kept pool on this machine: start one with"):
        attach()  # asked for after its lease ran out: one line


@pytest.mark.parametrize("nproc", [2, 3])
def test_f21_a_kernel_killed_while_attaching_leaves_the_pool_to_the_next(nproc: int, runtime: Path) -> None:
    pids, _ = _killed_driver(nproc, keep=60.0)
    env = {**os.environ, RUNTIME_DIR_VAR: str(runtime)}
    done = subprocess.run([sys.executable, "-c", ATTACH_KILLED], env=env, capture_output=True, timeout=60)
    assert done.returncode == -9
    time.sleep(0.5)
    assert alive(pids) == pids
    pool = attach()
    try:
        assert pool.run("kept + 1").value == {"text/plain": "42"}
        assert pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())").value == {
            "text/plain": str(nproc)
        }
    finally:
        pool.shutdown()
    wait_gone(pids, within=5.0)


def test_f21_without_keep_the_ranks_end_with_their_kernel(runtime: Path) -> None:
    pids, directory = _killed_driver(2, keep=0.0)
    wait_gone(pids, within=3.0)
    assert not (directory / "kept.json").exists()
    assert kept_pools() == []


def test_f21_attaching_a_pool_that_lost_a_rank_leaves_the_running_pool_alone(runtime: Path) -> None:
    """Checked before this kernel's pool is let go: a kept pool with a rank gone is refused in one
    line, and the pool this kernel runs keeps running with its state."""
    import signal

    from jupyter_shard import Pool

    pids, _ = _killed_driver(2, keep=60.0)
    os.kill(pids[1], signal.SIGKILL)
    wait_gone(pids[1:], within=5.0)
    said: list[str] = []
    with Pool(nproc=2, device="cpu", strategy="ddp") as mine:
        mine.run("mine = 5")
        with pytest.raises(PoolError) as refused:
            attach(None, False, mine, said.append)
        assert said == [] and mine.started and mine.run("mine").value == {"text/plain": "5"}
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and f"process {pids[1]} has ended" in message
    for pool in kept_pools():
        subprocess.run([sys.executable, "-m", "jupyter_shard", "stop", pool.id, "--force"], timeout=60)
    wait_gone(pids, within=10.0)


# A kernel attaching at a given moment (two of them race), saying how it went. Its attach takes a
# second longer between binding the socket and naming itself in the record (the window two kernels
# used to both get through), and it holds the pool a while before letting go.
ATTACH_AT = """
import sys, time
import jupyter_shard.pool.keep as keep
from jupyter_shard import PoolError
slow = keep._wait_connected
keep._wait_connected = lambda pool: (time.sleep(1.0), slow(pool))[1]
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
try:
    pool = keep.attach()
except PoolError as exc:
    print("REFUSED", exc, flush=True)
else:
    print("ATTACHED", pool.run("kept + 1").value["text/plain"], flush=True)
    time.sleep(3.0)
    pool.release()
"""


def test_f21_two_kernels_attaching_at_once_get_one_owner_and_one_refusal(runtime: Path) -> None:
    pids, _ = _killed_driver(2, keep=60.0)
    env = {**os.environ, RUNTIME_DIR_VAR: str(runtime)}
    at = str(time.time() + 3.0)
    racers = [
        subprocess.Popen([sys.executable, "-c", ATTACH_AT, at], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    said = sorted(proc.communicate(timeout=90)[0].strip() for proc in racers)
    assert said[0] == "ATTACHED 42", said
    assert said[1].startswith("REFUSED pool ") and (
        "was attached by kernel pid" in said[1] or "is attached to kernel pid" in said[1]
    ), said
    assert alive(pids) == pids
    pool = attach()  # both let go: the pool is whole for the next kernel
    try:
        assert pool.run("kept + 1").value == {"text/plain": "42"}
    finally:
        pool.shutdown()


TAKE_OVER = """
from jupyter_shard import PoolError
from jupyter_shard.pool.keep import attach
try:
    attach(None, True)
except PoolError as exc:
    print("REFUSED", exc, flush=True)
"""


def test_f21_a_take_over_that_times_out_is_withdrawn(runtime: Path) -> None:
    """The owner runs a cell longer than the take-over waits: the request is withdrawn, and when the
    cell ends the owner keeps its pool (it used to let go then, for a kernel that had given up)."""
    from jupyter_shard import Pool

    env = {**os.environ, RUNTIME_DIR_VAR: str(runtime)}
    with Pool(nproc=2, device="cpu", strategy="ddp", keep=60.0) as pool:
        pool.run("import time\nkept = 41")
        run = pool.run_background("time.sleep(8)")
        done = subprocess.run(
            [sys.executable, "-c", TAKE_OVER], env=env, capture_output=True, text=True, timeout=60
        )
        assert "REFUSED" in done.stdout and "the request was withdrawn" in done.stdout, (
            done.stdout + done.stderr
        )
        record = json.loads((pool.directory / "kept.json").read_text())  # type: ignore[operator]
        assert "take_over" not in record and record["owner"][0] == os.getpid()
        while run.running:
            time.sleep(0.1)
        time.sleep(1.0)  # the owner's watcher looks every 0.1 s
        assert pool.started and pool.run("kept + 1").value == {"text/plain": "42"}
        assert json.loads((pool.directory / "kept.json").read_text())["owner"][0] == os.getpid()  # type: ignore[operator]


def test_f21_an_attached_pool_set_to_keep_0_is_not_taken_for_a_dead_kernels(runtime: Path) -> None:
    """Attached, then ``--keep 0``: pool.json names the attaching kernel, so another kernel's
    stale-pool clean-up finds it alive and leaves the pool's directory and ranks be (it used to find
    the first, dead kernel and kill them)."""
    from jupyter_shard.pool.lifecycle import clean_stale_pools

    pids, directory = _killed_driver(2, keep=60.0)
    pool = attach()
    try:
        pool.keep = 0  # as %%distributed --keep 0 sets it
        assert not (directory / "kept.json").exists()
        assert json.loads((directory / "pool.json").read_text())["kernel"][0] == os.getpid()
        assert directory not in clean_stale_pools() and directory.exists()
    finally:
        pool.shutdown()
    wait_gone(pids, within=5.0)


def test_f21_a_restart_after_attaching_forks_from_a_zygote_started_at_the_attach(runtime: Path) -> None:
    """A kernel that attached has no zygote of its own: the attach starts one, so that a restart
    (after a rank of the adopted pool died) forks its ranks from it instead of waiting for a new one
    to import torch."""
    import signal

    from jupyter_shard.launchers import zygote

    zygote.close_all()  # (an earlier test's pool in this process leaves its own)
    pids, _ = _killed_driver(2, keep=60.0)
    pool = attach()
    try:
        warmed = [c.pid for c in zygote.client._zygotes.values() if c.alive()]
        assert len(warmed) == 1
        os.kill(pids[1], signal.SIGKILL)
        wait_gone([pids[1]], within=5.0)
        pool.restart()
        assert f"pid {warmed[0]}" in pool.launcher.launch_path()
        assert pool.run("x = shard.rank").ok
    finally:
        pool.keep = 0
        pool.shutdown()
        zygote.close_all()
    wait_gone(pids, within=5.0)


# A driving process whose pool rebuilds its process group once (a cell destroys it), then is killed.
DRIVER_REGROUPED = """
import json, os, signal, sys
from jupyter_shard import Pool
pool = Pool(nproc=2, device="cpu", strategy="ddp", keep=60.0, timeout=15.0)
pool.start()
pool.run("import torch, torch.distributed as dist\\nkept = 41\\ndist.destroy_process_group()")
pool.run("dist.all_reduce(torch.ones(1))")  # on the group rebuilt before this cell
print(json.dumps({"pids": [r.handle.pid for r in pool.ranks]}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_f21_an_attached_pool_rebuilds_its_group_on_a_store_no_earlier_kernel_used(runtime: Path) -> None:
    """The kernel that started the pool rebuilt its process group once (on a store in the pool's
    directory); the kernel that attached rebuilds it again: on a store of its own, not the first
    one's (whose stale keys made the new group's rendezvous hang until the collective timeout)."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER_REGROUPED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -9, done.stderr[-2000:]
    pids = json.loads(done.stdout.strip().splitlines()[-1])["pids"]
    pool = attach()
    try:
        began = time.monotonic()
        pool.run("dist.destroy_process_group()")
        result = pool.run("t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item(), kept)")
        assert result.ok
        assert time.monotonic() - began < 10, "the rebuilt group's rendezvous waited"
        assert [r.handle.pid for r in pool.ranks] == pids  # the same ranks: rebuilt, not restarted
    finally:
        pool.keep = 0
        pool.shutdown()
    wait_gone(pids, within=5.0)


def test_f21_a_stopped_rank_still_ends_with_the_lease(runtime: Path) -> None:
    """A rank stopped (SIGSTOP, as a SLURM suspend does) cannot end itself at lease end: rank 0 ends
    it before it removes the record, so no process is left that nothing can find."""
    import signal

    pids, directory = _killed_driver(3, keep=2.0)
    os.kill(pids[2], signal.SIGSTOP)
    wait_gone(pids, within=8.0)
    assert not directory.exists()


def test_f21_killing_an_adopted_rank_never_kills_a_process_that_took_its_pid() -> None:
    """The pid now names another process (another start time): kill_tree leaves it alone; the rank
    itself (its start time) is killed."""
    import signal

    from jupyter_shard.launchers.base import started_at
    from jupyter_shard.launchers.local import AdoptedRank

    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = started_at(other.pid)
        assert started is not None
        AdoptedRank(0, other.pid, started - 5.0).kill_tree()  # recorded for an earlier process
        time.sleep(0.2)
        assert other.poll() is None
        AdoptedRank(0, other.pid, started).kill_tree()
        assert other.wait(5) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()
