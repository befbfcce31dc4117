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
    "suspend_background",
    "kernel_replaced",
    "take_over",
    "attach_race",
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
    adopted: bool = False  # the ranks were attached to, not started, by this kernel (not its children)
    kcount: int = 0
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    survived: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    pids_seen: set[int] = field(default_factory=set)
    replaced: set[int] = field(default_factory=set)  # processes of killed kernels: must all end
    kinds: tuple[str, ...] = FAULTS  # what the deck is dealt from
    deck: list[str] = field(default_factory=list)
    last: Cell = field(default_factory=lambda: Cell(False, "", "", "", 0.0))  # the last cell run
    # per fault kind: seconds from the failing cell's end to the end of the next working cell
    back: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))

    def run(self, code: str, action: Callable[[], None] | None = None, at: float = 1.0) -> Cell:
        self.cells += 1
        cell = self.last = self.kernel.execute(code, action, at)
        if STATE_LOST in cell.text:  # new ranks: this kernel's children
            self.may_lose, self.adopted = True, False
        return cell

    def adopt(self, kernel: Kernel, loaded: bool = False) -> None:
        """From now on cells run in ``kernel`` (a new one: its own counter starts at 0)."""
        self.kernel, self.kcount = kernel, 0
        if not loaded:
            self.run("%load_ext jupyter_shard")

    def retire(self, kernel: Kernel, ranks: set[int]) -> None:
        """Shut ``kernel`` down (not the current one); its processes, the kept ``ranks`` aside, must
        all end (checked at the end)."""
        with contextlib.suppress(psutil.Error):
            self.replaced |= {kernel.pid} | {
                c.pid for c in psutil.Process(kernel.pid).children(recursive=True) if c.pid not in ranks
            }
        kernel.shutdown()

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
            self.deck = list(self.kinds)
            self.rng.shuffle(self.deck)
        kind = self.deck.pop()
        self.injected[kind] += 1
        rank = self.rng.randrange(self.nproc)
        started = time.monotonic()
        from benchmarks.soak.faults import INJECT  # (faults.py builds on this module)

        cell = INJECT[kind](self, rank)
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

    def expect_failure(self, cell: Cell, kind: str, needles: list[str], within: float) -> None:
        """A fault's cell failed, within ``within`` seconds, saying each of ``needles``."""
        if cell.ok:
            self.fail(f"{kind}: the cell succeeded")
        missing = [n for n in needles if n not in cell.text]
        if missing:
            self.fail(f"{kind}: the message lacks {missing!r}", cell)
        if cell.elapsed > within:
            self.fail(f"{kind}: the cell took {cell.elapsed:.1f} s (limit {within:g} s)")

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


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
