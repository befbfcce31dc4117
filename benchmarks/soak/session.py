"""The soak's session: the cells it runs, the faults it injects, how it checks that the pool recovered
and that nothing was lost, and which processes outlived their rank (``__main__.py`` says why)."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from benchmarks.common.kernel import start_kernel

SLOW = 5.0  # back to a working cell within 5 s of the failing cell's end
CELL_LIMIT = 120.0  # a cell still running after this is a hang: interrupted, then given up on
FAULTS = (
    "exit",
    "sigkill",
    "raise",
    "interrupt",
    "interrupt_collective",
    "restart",
    "suspend_resume",
    "resume_resized",
    "kill_mid_suspend",
    "kernel_replaced",
)
STATE_LOST = "rank state is lost"  # every restart notice of the product says this
ANSI = re.compile(r"\x1b\[[0-9;]*m")

COMPUTE = """%%distributed
import torch, torch.distributed as dist
try:
    counter
except NameError:
    counter = 0
    print("SOAK fresh")
counter += 1
_t = torch.tensor([float(counter)])
dist.all_reduce(_t)
print("SOAK counter", counter, _t.item())
"""
TRAIN = """%%distributed
import torch, torch.distributed as dist
_w = torch.zeros(4, requires_grad=True)
_opt = torch.optim.SGD([_w], lr=0.05)
for _ in range({steps}):
    _x = torch.randn(16, 4)
    _loss = ((_x @ _w - _x.sum(1)) ** 2).mean()
    _opt.zero_grad()
    _loss.backward()
    dist.all_reduce(_w.grad)
    _opt.step()
    shard.log(loss=_loss)
"""
HISTORY = "from jupyter_shard import history\nprint('SOAK history', len(history()), history().thinned)"
PIDS = (
    "from jupyter_shard.pool.pool import latest_pool\n"
    "print('SOAK pids', *[s.pid for s in latest_pool().status()])"
)
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


@dataclass
class Cell:
    ok: bool
    stdout: str
    stderr: str
    error: str
    elapsed: float

    @property
    def text(self) -> str:
        return "\n".join((self.stdout, self.stderr, self.error))


class Hang(Exception):
    """A cell that did not end even after an interrupt."""


class Kernel:
    """A kernel subprocess of this interpreter and a blocking client, as Jupyter starts one."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.km, self.kc = start_kernel({"JUPYTER_SHARD_LOG_DIR": log_dir})

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)  # type: ignore[union-attr]

    def execute(self, code: str, action: Callable[[], None] | None = None, at: float = 1.0) -> Cell:
        """Run a cell; ``action`` runs ``at`` seconds after it was sent (a fault from outside)."""
        msg_id = self.kc.execute(code)
        started = time.monotonic()
        deadline, interrupted = started + CELL_LIMIT, False
        streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
        errors: list[str] = []
        while True:
            now = time.monotonic()
            if action is not None and now - started >= at:
                action()
                action = None
            if now > deadline:
                if interrupted:
                    raise Hang(f"no end {CELL_LIMIT:.0f} s + 30 s after an interrupt: {code[:60]!r}")
                self.km.interrupt_kernel()
                errors.append(f"(soak: interrupted after {CELL_LIMIT:.0f} s)")
                deadline, interrupted = now + 30.0, True
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                streams[content["name"]].append(content["text"])
            elif kind == "error":
                errors.append("\n".join(content["traceback"]) or f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=30)
        return Cell(
            ok=reply["content"]["status"] == "ok" and not interrupted,
            stdout="".join(streams["stdout"]),
            stderr="".join(streams["stderr"]),
            error=ANSI.sub("", "\n".join(errors)),
            elapsed=time.monotonic() - started,
        )

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)

    def kill(self) -> None:
        """SIGKILL the kernel process, as the OOM killer or a crash would, and drop the client."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.kc.stop_channels()
        with contextlib.suppress(Exception):  # already dead: only its resources are cleaned up
            self.km.shutdown_kernel(now=True)


@dataclass
class Soak:
    kernel: Kernel
    rng: random.Random
    nproc: int
    suspend_dir: str = ""  # where the suspend faults write (one directory, replaced each time)
    base_nproc: int = 0  # the world size the soak began with; a resized resume goes one above and back
    cells: int = 0
    counter: int | None = None  # rank 0's counter as it should be; None before the first compute
    may_lose: bool = True  # a restart was announced since the last compute check
    fresh: bool = False  # the last compute cell found no counter (new ranks)
    kcount: int = 0
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    survived: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    pids_seen: set[int] = field(default_factory=set)
    replaced: set[int] = field(default_factory=set)  # processes of killed kernels: must all end
    deck: list[str] = field(default_factory=list)
    # per fault kind: seconds from the failing cell's end to the end of the next working cell
    back: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))

    def run(self, code: str, action: Callable[[], None] | None = None, at: float = 1.0) -> Cell:
        self.cells += 1
        cell = self.kernel.execute(code, action, at)
        if STATE_LOST in cell.text:
            self.may_lose = True
        return cell

    def fail(self, what: str, cell: Cell | None = None) -> None:
        lines = (cell.error or cell.stderr or cell.stdout).strip().splitlines() if cell else []
        detail = f": {lines[0][:160]}" if lines else ""
        self.failures.append(f"cell {self.cells}: {what}{detail}")

    # -- normal cells --------------------------------------------------------------------------

    def compute(self) -> bool:
        cell = self.run(COMPUTE)
        if not cell.ok:
            return False
        seen = {
            int(k): (int(c), float(t))
            for k, c, t in re.findall(r"\[rank (\d+)\] SOAK counter (\d+) (\S+)", cell.stdout)
        }
        fresh = self.fresh = "SOAK fresh" in cell.stdout
        if sorted(seen) != list(range(self.nproc)) or len({c for c, _ in seen.values()}) != 1:
            self.lost.append(f"cell {self.cells}: ranks disagree on the counter: {seen}")
        value, total = seen.get(0, (0, 0.0))
        if total != value * self.nproc:
            self.lost.append(f"cell {self.cells}: all_reduce gave {total}, expected {value * self.nproc}")
        if fresh and not self.may_lose and self.counter is not None:
            self.lost.append(
                f"cell {self.cells}: rank counter reset (was {self.counter}) with no restart notice"
            )
        elif not fresh and self.counter is not None and value != self.counter + 1:
            self.lost.append(f"cell {self.cells}: rank counter {value}, expected {self.counter + 1}")
        self.counter, self.may_lose = value, False
        return True

    def train(self) -> None:
        steps = self.rng.randint(5, 40)
        before = self._history()
        cell = self.run(TRAIN.format(steps=steps))
        if not cell.ok:
            self.fail("train cell failed", cell)
            return
        after = self._history()
        if (
            before is not None
            and after is not None
            and not after[1]
            and after[0] - before[0] != steps * self.nproc
        ):
            self.lost.append(
                f"cell {self.cells}: {after[0] - before[0]} shard.log records of {steps * self.nproc}"
            )

    def _history(self) -> tuple[int, bool] | None:
        cell = self.run(HISTORY)
        found = re.search(r"SOAK history (\d+) (True|False)", cell.stdout)
        if not found:
            self.fail("jupyter_shard.history() failed", cell)
            return None
        return int(found.group(1)), found.group(2) == "True"

    def push_pull(self) -> None:
        n = self.rng.randint(1, 5000)
        cell = self.run(f"soak_payload = list(range({n}))\n%dist_push soak_payload")
        if not cell.ok:
            self.fail("%dist_push failed", cell)
            return
        cell = self.run("%%distributed\nprint('SOAK sum', sum(soak_payload))")
        sums = re.findall(r"SOAK sum (\d+)", cell.stdout)
        if not cell.ok or sums != [str(n * (n - 1) // 2)] * self.nproc:
            self.lost.append(f"cell {self.cells}: pushed list summed to {sums} on the ranks")
        if self.counter is None:
            return
        cell = self.run("%dist_pull counter\nprint('SOAK pulled', counter)")
        pulled = re.search(r"SOAK pulled (\d+)", cell.stdout)
        if not cell.ok or pulled is None:
            self.fail("%dist_pull failed", cell)
        elif int(pulled.group(1)) != self.counter:
            self.lost.append(f"cell {self.cells}: pulled counter {pulled.group(1)}, expected {self.counter}")

    def kernel_cell(self) -> None:
        cell = self.run("kcount = globals().get('kcount', 0) + 1\nprint('SOAK kcount', kcount)")
        found = re.search(r"SOAK kcount (\d+)", cell.stdout)
        if found is None or int(found.group(1)) != self.kcount + 1:
            self.lost.append(
                f"cell {self.cells}: kernel counter {found and found.group(1)}, expected {self.kcount + 1}"
            )
        self.kcount += 1

    def rank_pids(self) -> list[int]:
        cell = self.run(PIDS)
        found = re.search(r"SOAK pids ([\d ]+)", cell.stdout)
        pids = [int(p) for p in found.group(1).split()] if found else []
        self.pids_seen.update(pids)
        return pids

    # -- faults --------------------------------------------------------------------------------

    def fault(self) -> None:
        if not self.deck:
            self.deck = list(FAULTS)
            self.rng.shuffle(self.deck)
        kind = self.deck.pop()
        self.injected[kind] += 1
        rank = self.rng.randrange(self.nproc)
        started = time.monotonic()
        cell: Cell = getattr(self, f"_fault_{kind}")(rank)
        ended = time.monotonic()
        recovered = self.recover()
        back = time.monotonic() - ended
        if recovered:
            self.survived[kind] += 1
            self.back[kind].append(back)
            if back > SLOW:
                self.fail(f"{kind}: back to a working cell only {back:.1f} s after the failing cell ended")
        outcome = ("restarted" if self.fresh else "state kept") if recovered else "NOT RECOVERED"
        said = (cell.error or cell.stderr or cell.stdout).strip().splitlines()
        print(
            f"[{time.strftime('%H:%M:%S')}] {kind:<20} rank {rank}  cell {cell.elapsed:4.1f} s  "
            f"{outcome:<10} back in {back:4.1f} s (all {time.monotonic() - started:4.1f} s)  "
            f"| {said[0][:90] if said else ''}",
            flush=True,
        )

    def _expect_failure(self, cell: Cell, kind: str, needles: list[str], within: float) -> None:
        if cell.ok:
            self.fail(f"{kind}: the cell succeeded")
        missing = [n for n in needles if n not in cell.text]
        if missing:
            self.fail(f"{kind}: the message lacks {missing!r}", cell)
        if cell.elapsed > within:
            self.fail(f"{kind}: the cell took {cell.elapsed:.1f} s (limit {within:g} s)")

    def _fault_exit(self, rank: int) -> Cell:
        self.rank_pids()
        cell = self.run(EXIT.format(rank=rank))
        self._expect_failure(cell, "exit", [f"rank {rank} exited with code 3"], 10.0)
        return cell

    def _fault_sigkill(self, rank: int) -> Cell:
        pid = self.rank_pids()[rank]
        if self.rng.random() < 0.5:
            cell = self.run(SLEEP, lambda: _kill_if_alive(pid), at=self.rng.uniform(0.5, 2.0))
        else:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            cell = self.run(COMPUTE)  # between cells: the next cell is refused, naming the dead rank
        self._expect_failure(cell, "sigkill", [f"rank {rank}", "SIGKILL"], 15.0)
        return cell

    def _fault_raise(self, rank: int) -> Cell:
        self.rank_pids()
        cell = self.run(RAISE.format(rank=rank))
        self._expect_failure(cell, "raise", [f"rank {rank} failed first", "ValueError: soak: injected"], 30.0)
        return cell

    def _fault_interrupt(self, rank: int) -> Cell:
        cell = self.run(SLEEP, self.kernel.km.interrupt_kernel, at=self.rng.uniform(0.5, 2.0))
        self._expect_failure(cell, "interrupt", ["KeyboardInterrupt"], 15.0)
        return cell

    def _fault_interrupt_collective(self, rank: int) -> Cell:
        self.rank_pids()
        cell = self.run(STUCK_IN_COLLECTIVE, self.kernel.km.interrupt_kernel, at=self.rng.uniform(0.5, 2.0))
        self._expect_failure(cell, "interrupt_collective", ["KeyboardInterrupt"], 20.0)
        return cell

    def _fault_restart(self, rank: int) -> Cell:
        cell = self.run("%dist_restart")
        if not cell.ok or STATE_LOST not in cell.text:
            self.fail("%dist_restart did not say that rank state is lost", cell)
        return cell

    def _fault_suspend_resume(self, rank: int) -> Cell:
        """Suspend and resume at the same world size: the counter goes on (the compute check)."""
        return self._suspend_and_resume(self.nproc)

    def _fault_resume_resized(self, rank: int) -> Cell:
        """Resume at another world size: every rank goes on from rank 0's counter."""
        new = self.base_nproc + 1 if self.nproc == self.base_nproc else self.base_nproc
        return self._suspend_and_resume(new)

    def _suspend_and_resume(self, nproc: int) -> Cell:
        self.rank_pids()
        cell = self.run(f"%dist_suspend {self.suspend_dir}")
        if not cell.ok or "suspended" not in cell.stdout:
            self.fail("%dist_suspend failed", cell)
            return cell
        cell = self.run(f"%dist_resume {self.suspend_dir} --nproc {nproc}")
        if not cell.ok or f"on {nproc} ranks" not in cell.stdout:
            self.fail("%dist_resume failed", cell)
            return cell
        self.nproc = nproc
        return cell

    def _fault_kill_mid_suspend(self, rank: int) -> Cell:
        """A rank SIGKILLed while the pool suspends: either the suspend finished first (then it is
        resumed) or it fails in one line naming the dead rank, and an earlier suspend in the
        directory is still whole."""
        pid = self.rank_pids()[rank]
        earlier = os.path.isfile(os.path.join(self.suspend_dir, "manifest.json"))
        cell = self.run(
            f"%dist_suspend {self.suspend_dir}",
            lambda: _kill_if_alive(pid),
            at=self.rng.uniform(0, 0.3),
        )
        if cell.ok:
            resumed = self.run(f"%dist_resume {self.suspend_dir}")
            if not resumed.ok:
                self.fail("%dist_resume after a suspend that beat the kill failed", resumed)
            return cell
        self._expect_failure(cell, "kill_mid_suspend", ["the suspend failed", f"rank {rank}"], 30.0)
        if earlier and not os.path.isfile(os.path.join(self.suspend_dir, "manifest.json")):
            self.lost.append(f"cell {self.cells}: the earlier suspend in {self.suspend_dir} is gone")
        return cell

    def _fault_kernel_replaced(self, rank: int) -> Cell:
        """The kernel SIGKILLed while its pool is kept (``--keep``), and a new kernel attaching: every
        rank's state goes on (the compute check after it), the kept lease is set back to 0, and
        nothing of the killed kernel is left (checked at the end)."""
        ranks = set(self.rank_pids())
        cell = self.run("%%distributed --keep 5m\nprint('SOAK kept')")
        if not cell.ok:
            self.fail("--keep 5m failed", cell)
            return cell
        old = self.kernel
        with contextlib.suppress(psutil.Error):
            self.replaced |= {old.pid} | {
                c.pid for c in psutil.Process(old.pid).children(recursive=True) if c.pid not in ranks
            }
        old.kill()
        self.kernel, self.kcount = Kernel(old.log_dir), 0
        self.run("%load_ext jupyter_shard")
        cell = self.run("%dist_attach")
        if not cell.ok:
            self.fail("%dist_attach after the kernel was killed failed", cell)
            return cell
        unkept = self.run("%%distributed --keep 0\nprint('SOAK unkept')")
        if not unkept.ok:
            self.fail("--keep 0 on the attached pool failed", unkept)
            return unkept
        time.sleep(2.0)  # a rank that would end by itself after --keep 0 has done so by now
        if not self.compute():
            self.fail("the attached pool's first compute cell after --keep 0 failed")
        elif self.fresh:
            self.lost.append(f"cell {self.cells}: the attached pool's ranks started afresh")
        return cell

    def recover(self) -> bool:
        """The next compute cell works, after %dist_restart if the product asks for one."""
        for _ in range(3):
            if self.compute():
                self.kernel_cell()
                self.rank_pids()
                return True
            cell = self.run("%dist_restart")
            if not cell.ok:
                self.fail("%dist_restart failed", cell)
        self.fail("the pool did not recover after three %dist_restart")
        return False

    # -- the end ---------------------------------------------------------------------------------

    def orphans(self) -> list[str]:
        """Kernel children that are not current ranks, and earlier ranks still alive."""
        current = set(self.rank_pids())
        found = []
        for child in psutil.Process(self.kernel.pid).children(recursive=True):
            try:
                status = child.status()
            except psutil.NoSuchProcess:
                continue
            command = ""
            with contextlib.suppress(psutil.Error):
                command = " ".join(child.cmdline())
            if "jupyter_shard.launchers.zygote" in command and status != psutil.STATUS_ZOMBIE:
                continue  # the kernel's fork server while the kernel runs (checked at shutdown)
            if child.pid not in current or status == psutil.STATUS_ZOMBIE:
                found.append(f"pid {child.pid} ({status}) {command[:80]}")
        for pid in sorted(self.pids_seen - current):
            if alive(pid):
                found.append(f"earlier rank pid {pid} still alive")
        for pid in sorted(self.replaced - current):
            if alive(pid):
                found.append(f"pid {pid} of a killed kernel still alive")
        return found


def _kill_if_alive(pid: int) -> None:
    """SIGKILL ``pid``, unless it already ended (a suspend that finished first ends its ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
