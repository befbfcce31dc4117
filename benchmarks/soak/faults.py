"""The soak's faults: each injects one, checks that the failing cell said what RELIABILITY.md says it
must, and returns that cell; :meth:`Soak.fault` then checks that the pool recovers.

Besides faults on the ranks (exit, SIGKILL, a raise, interrupts, a restart) the deck holds every way
the product keeps, moves or restores state: suspend and resume (at the same and at another world
size), a rank killed mid-suspend, a suspend asked for while a background run goes on, and kept pools
moving between kernels (the kernel SIGKILLed and a new one attaching, a take-over asked for during a
running cell and then between cells, two kernels attaching at once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import psutil

from benchmarks.soak.session import COMPUTE, Cell, Kernel, Soak

EXIT = """%%distributed
import os, time, torch, torch.distributed as dist
if shard.rank == {rank}:
    time.sleep(0.3)
    os._exit(3)
dist.all_reduce(torch.ones(1))
time.sleep(30)
"""
SLEEP = "%%distributed\nimport time\nfor _ in range(300):\n    time.sleep(0.1)\n"
RAISE = """%%distributed
import torch, torch.distributed as dist
if shard.rank == {rank}:
    raise ValueError("soak: injected on rank {rank}")
dist.all_reduce(torch.ones(1))
"""
STUCK_IN_COLLECTIVE = """%%distributed
import time, torch, torch.distributed as dist
if shard.rank == 0:
    dist.all_reduce(torch.ones(1))
else:
    time.sleep(60)
"""
KEEP = "%%distributed --keep 5m\nprint('SOAK kept')"
BACKGROUND = "%%distributed --bg\nimport time\nsoak_bg = False\ntime.sleep(3)\nsoak_bg = True"
BUSY = "%%distributed\nimport time\nfor _ in range({tenths}):\n    time.sleep(0.1)\nprint('SOAK busy done')"


def exit_(soak: Soak, rank: int) -> Cell:
    soak.rank_pids()
    said = _ended(soak, rank, "exited with code 3")  # (the failing cell's restart makes new ranks)
    cell = soak.run(EXIT.format(rank=rank))
    soak.expect_failure(cell, "exit", [said], 10.0)
    return cell


def sigkill(soak: Soak, rank: int) -> Cell:
    pids = soak.rank_pids()
    if len(pids) <= rank:
        soak.fail(f"sigkill: rank {rank}'s pid was not found ({pids})")
        return soak.last
    pid = pids[rank]
    said = _ended(soak, rank, "was killed by SIGKILL")
    if soak.rng.random() < 0.5:
        cell = soak.run(SLEEP, lambda: kill_if_alive(pid), at=soak.rng.uniform(0.5, 2.0))
    else:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        cell = soak.run(COMPUTE)  # between cells: the next cell is refused, naming the dead rank
    soak.expect_failure(cell, "sigkill", [said], 15.0)
    return cell


def _ended(soak: Soak, rank: int, how: str) -> str:
    """How the product says that ``rank`` ended: the way it did, or (ranks this kernel attached to
    are not its children, so their exit status cannot be known here) that it ended."""
    return f"rank {rank} ended (its exit status is unknown" if soak.adopted else f"rank {rank} {how}"


def raise_(soak: Soak, rank: int) -> Cell:
    soak.rank_pids()
    cell = soak.run(RAISE.format(rank=rank))
    soak.expect_failure(cell, "raise", [f"rank {rank} failed first", "ValueError: soak: injected"], 30.0)
    return cell


def interrupt(soak: Soak, rank: int) -> Cell:
    cell = soak.run(SLEEP, soak.kernel.km.interrupt_kernel, at=soak.rng.uniform(0.5, 2.0))
    soak.expect_failure(cell, "interrupt", ["KeyboardInterrupt"], 15.0)
    return cell


def interrupt_collective(soak: Soak, rank: int) -> Cell:
    soak.rank_pids()
    cell = soak.run(STUCK_IN_COLLECTIVE, soak.kernel.km.interrupt_kernel, at=soak.rng.uniform(0.5, 2.0))
    soak.expect_failure(cell, "interrupt_collective", ["KeyboardInterrupt"], 20.0)
    return cell


def restart(soak: Soak, rank: int) -> Cell:
    cell = soak.run("%dist_restart")
    if not cell.ok or "rank state is lost" not in cell.text:
        soak.fail("%dist_restart did not say that rank state is lost", cell)
    return cell


# -- suspend and resume ---------------------------------------------------------------------------


def suspend_resume(soak: Soak, rank: int) -> Cell:
    """Suspend and resume at the same world size: the counter goes on (the compute check)."""
    return _suspend_and_resume(soak, soak.nproc)


def resume_resized(soak: Soak, rank: int) -> Cell:
    """Resume at another world size: every rank goes on from rank 0's counter."""
    new = soak.base_nproc + 1 if soak.nproc == soak.base_nproc else soak.base_nproc
    return _suspend_and_resume(soak, new)


def _suspend_and_resume(soak: Soak, nproc: int) -> Cell:
    soak.rank_pids()
    cell = soak.run(f"%dist_suspend {soak.suspend_dir}")
    if not cell.ok or "suspended" not in cell.stdout:
        soak.fail("%dist_suspend failed", cell)
        return cell
    cell = soak.run(f"%dist_resume {soak.suspend_dir} --nproc {nproc}")
    if not cell.ok or f"on {nproc} ranks" not in cell.stdout:
        soak.fail("%dist_resume failed", cell)
        return cell
    soak.nproc, soak.adopted = nproc, False
    return cell


def _manifest(soak: Soak) -> bool:
    return os.path.isfile(os.path.join(soak.suspend_dir, "manifest.json"))


def kill_mid_suspend(soak: Soak, rank: int) -> Cell:
    """A rank SIGKILLed while the pool suspends: either the suspend finished first (then it is
    resumed) or it fails in one line naming the dead rank, and an earlier suspend in the
    directory is still whole."""
    pids = soak.rank_pids()
    if len(pids) <= rank:
        soak.fail(f"kill_mid_suspend: rank {rank}'s pid was not found ({pids})")
        return soak.last
    pid = pids[rank]
    earlier = _manifest(soak)
    at = soak.rng.uniform(0, 0.3)
    cell = soak.run(f"%dist_suspend {soak.suspend_dir}", lambda: kill_if_alive(pid), at=at)
    if cell.ok:
        resumed = soak.run(f"%dist_resume {soak.suspend_dir}")
        if not resumed.ok:
            soak.fail("%dist_resume after a suspend that beat the kill failed", resumed)
        soak.adopted = False
        return cell
    soak.expect_failure(cell, "kill_mid_suspend", ["the suspend failed", f"rank {rank}"], 30.0)
    if earlier and not _manifest(soak):
        soak.lost.append(f"cell {soak.cells}: the earlier suspend in {soak.suspend_dir} is gone")
    return cell


def suspend_background(soak: Soak, rank: int) -> Cell:
    """A suspend asked for while a ``--bg`` run goes on is refused in one line that says how to go on
    (an earlier suspend in the directory untouched); ``%dist_wait`` then gives the run's end, and the
    suspend and resume that follow keep every rank's state."""
    soak.rank_pids()
    earlier = _manifest(soak)
    started = soak.run(BACKGROUND)
    if not started.ok:
        soak.fail("a --bg cell did not start", started)
        return started
    cell = soak.run(f"%dist_suspend {soak.suspend_dir}")
    soak.expect_failure(cell, "suspend_background", ["cannot suspend the pool", "%dist_wait"], 5.0)
    if earlier and not _manifest(soak):
        soak.lost.append(f"cell {soak.cells}: a refused suspend removed the one in {soak.suspend_dir}")
    waited = soak.run("%dist_wait")
    if not waited.ok:
        soak.fail("%dist_wait after the refused suspend failed", waited)
        return cell
    ended = soak.run("%%distributed\nprint('SOAK bg', soak_bg)")
    if ended.stdout.count("SOAK bg True") != soak.nproc:
        soak.lost.append(f"cell {soak.cells}: the background run did not end everywhere: {ended.text[:99]}")
    _suspend_and_resume(soak, soak.nproc)
    return cell


# -- kept pools moving between kernels ------------------------------------------------------------


def kernel_replaced(soak: Soak, rank: int) -> Cell:
    """The kernel SIGKILLed while its pool is kept (``--keep``), and a new kernel attaching: every
    rank's state goes on (the compute check after it), the kept lease is set back to 0, and
    nothing of the killed kernel is left (checked at the end)."""
    if _keep_and_kill(soak) is None:
        return soak.last
    soak.adopt(Kernel(soak.kernel.log_dir))
    cell = soak.run("%dist_attach")
    if not cell.ok:
        soak.fail("%dist_attach after the kernel was killed failed", cell)
        return cell
    soak.adopted = True
    _unkeep(soak)
    return cell


def attach_race(soak: Soak, rank: int) -> Cell:
    """The kernel SIGKILLed with its pool kept, and two new kernels attaching at the same moment:
    one gets the pool with every rank's state, the other is refused in one line naming the pool,
    and the loser's processes end with it."""
    ranks = _keep_and_kill(soak)
    if ranks is None:
        return soak.last
    kernels = [Kernel(soak.kernel.log_dir) for _ in range(2)]
    for kernel in kernels:
        kernel.execute("%load_ext jupyter_shard")
    cells: list[Cell | None] = [None, None]
    go = threading.Barrier(2)

    def attach(i: int) -> None:
        go.wait()
        cells[i] = kernels[i].execute("%dist_attach")

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    soak.cells += 2
    won = [i for i, cell in enumerate(cells) if cell is not None and cell.ok]
    if len(won) != 1:
        for kernel in kernels:
            soak.retire(kernel, set())
        for pid in ranks:  # the kept pool nobody holds: ended, and a new kernel starts its own
            kill_if_alive(pid)
        soak.adopt(Kernel(soak.kernel.log_dir))
        soak.run(f"%%distributed --nproc {soak.nproc} --device cpu\nimport torch")
        soak.fail(f"attach_race: {len(won)} of 2 kernels attaching at once got the pool")
        soak.may_lose, soak.adopted = True, False
        return cells[0] or soak.last
    winner, loser = kernels[won[0]], kernels[1 - won[0]]
    refused = cells[1 - won[0]]
    assert refused is not None
    named = ("attached by kernel pid", "attached to kernel pid", "being attached by another kernel")
    if not any(said in refused.text for said in named):
        soak.fail("attach_race: the refused kernel was not told who holds the pool", refused)
    _hand_over(soak, winner, loser, ranks)
    return refused


def take_over(soak: Soak, rank: int) -> Cell:
    """Another kernel asks with ``--take-over`` while a cell runs: refused within 5 s and withdrawn
    (the cell goes on, the pool stays this kernel's with its state); asked again between cells, the
    other kernel gets the pool with every rank's state, and the first kernel's next cell says that
    its pool was taken over (then that kernel is shut down and must leave nothing)."""
    ranks = set(soak.rank_pids())
    kept = soak.run(KEEP)
    if not kept.ok:
        soak.fail("--keep 5m failed", kept)
        return kept
    other = Kernel(soak.kernel.log_dir)
    other.execute("%load_ext jupyter_shard")
    asked: list[Cell] = []
    busy = soak.run(BUSY.format(tenths=80), lambda: asked.append(other.execute("%dist_attach --take-over")))
    if not busy.ok or busy.stdout.count("SOAK busy done") != soak.nproc:
        soak.fail("take_over: the cell running while another kernel asked for the pool failed", busy)
    refused = asked[0] if asked else busy
    soak.expect_failure(refused, "take_over", ["did not let go", "withdrawn"], 8.0)
    counted = soak.counter is not None
    if not soak.compute():
        soak.fail("take_over: the first kernel's compute cell after a withdrawn take-over failed")
    elif soak.fresh and counted:
        soak.lost.append(f"cell {soak.cells}: a withdrawn take-over restarted the first kernel's ranks")
    taken = other.execute("%dist_attach --take-over")
    soak.cells += 1
    if not taken.ok:
        soak.fail("take_over: --take-over between cells failed", taken)
        soak.retire(other, ranks)
        return refused
    first = soak.kernel  # (its own pool, started by the next cell, is not kept: it ends with it)
    said = first.execute("%%distributed --keep 0\nprint('SOAK own pool')")
    soak.cells += 1
    if "took the kept pool over" not in said.text:
        soak.fail("take_over: the first kernel's next cell did not say its pool was taken over", said)
    _hand_over(soak, other, first, ranks)
    return refused


def _hand_over(soak: Soak, new: Kernel, old: Kernel, ranks: set[int]) -> None:
    """Cells run in ``new``, which attached to the pool's ``ranks``; ``old`` is shut down (its
    processes must end), and the pool is set back to end with its kernel."""
    soak.adopt(new, loaded=True)
    soak.adopted = True
    soak.retire(old, ranks)
    _unkeep(soak)


def _keep_and_kill(soak: Soak) -> set[int] | None:
    """Keep the pool for 5 minutes and SIGKILL the kernel; its own processes (the ranks aside) are
    noted, to be checked gone at the end. The ranks' pids, or None if the pool could not be kept."""
    ranks = set(soak.rank_pids())
    cell = soak.run(KEEP)
    if not cell.ok:
        soak.fail("--keep 5m failed", cell)
        return None
    old = soak.kernel
    with contextlib.suppress(psutil.Error):
        soak.replaced |= {old.pid} | {
            c.pid for c in psutil.Process(old.pid).children(recursive=True) if c.pid not in ranks
        }
    old.kill()
    return ranks


def _unkeep(soak: Soak) -> None:
    """``--keep 0`` on the pool this kernel attached to: it then ends with this kernel, and every
    rank's state goes on (a rank that would end by itself after it has done so within 2 s)."""
    unkept = soak.run("%%distributed --keep 0\nprint('SOAK unkept')")
    if not unkept.ok:
        soak.fail("--keep 0 on the attached pool failed", unkept)
        return
    time.sleep(2.0)
    counted = soak.counter is not None  # (before the soak's first compute cell no rank has a counter)
    if not soak.compute():
        soak.fail("the attached pool's first compute cell after --keep 0 failed")
    elif soak.fresh and counted:
        soak.lost.append(f"cell {soak.cells}: the attached pool's ranks started afresh")


def kill_if_alive(pid: int) -> None:
    """SIGKILL ``pid``, unless it already ended (a suspend that finished first ends its ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


INJECT: dict[str, Callable[[Soak, int], Cell]] = {
    "exit": exit_,
    "sigkill": sigkill,
    "raise": raise_,
    "interrupt": interrupt,
    "interrupt_collective": interrupt_collective,
    "restart": restart,
    "suspend_resume": suspend_resume,
    "resume_resized": resume_resized,
    "kill_mid_suspend": kill_mid_suspend,
    "suspend_background": suspend_background,
    "kernel_replaced": kernel_replaced,
    "take_over": take_over,
    "attach_race": attach_race,
}
