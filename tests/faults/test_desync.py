"""F3, F4, F6, F9: a desync or a hang ends the cell promptly, says who waited where, and recovers.

A gloo collective whose peer has left the cell waits for the full collective timeout and does not
see SIGINT. The pool closes the process group on the idle ranks instead, which makes the blocked
collective fail at once; every rank keeps its state and the next cell first rebuilds the group.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from jupyter_shard.pool.cell import DESYNC_GRACE
from jupyter_shard.pool.escalation import INTERRUPT_GRACE
from tests.faults.conftest import alive, interrupt_after, rank_pids

pytestmark = pytest.mark.timeout(120)

# A few training steps first: after autograd steps torch keeps a reference to the process group,
# so closing it alone would not free a blocked peer.
SETUP = """%%distributed --nproc 2 --device cpu
import time, torch, torch.distributed as dist
kept = 41
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.05)
for _ in range(20):
    x = torch.randn(16, 4)
    loss = ((x @ w - x.sum(1)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    dist.all_reduce(w.grad)
    opt.step()
    shard.log(loss=loss)
"""
NEXT = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('kept', kept + 1, 'sum', t.item())"


def _start(kernel: Any) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(SETUP).ok


def _shown(run: Any) -> str:
    """What a line magic showed: its printed text and its value's text."""
    values = [d["text/plain"] for d in run.data("execute_result")]
    return "\n".join([run.stream(), *values])


def _recovered_with_state(kernel: Any, failed_at: float) -> str:
    """The next cell rebuilds the group, keeps every rank's state and runs a collective, ending
    within 5 s of the failing cell's end."""
    nxt = kernel.execute(NEXT)
    back = time.monotonic() - failed_at
    assert nxt.ok, nxt.error_text()
    assert back < 5.0, f"back to a working cell {back:.1f} s after the failing cell ended"
    assert "[rank 0] kept 42 sum 2.0" in nxt.stream() and "[rank 1] kept 42 sum 2.0" in nxt.stream()
    notices: str = nxt.stream()
    assert "rebuilt the process group after the desync in" in notices
    assert "rank state is kept" in notices
    return notices


def test_f3_one_rank_raises_while_the_other_waits_in_all_reduce(kernel: Any) -> None:
    _start(kernel)
    run = kernel.execute(
        "%%distributed --timeout 30\n"
        "if shard.rank == 0:\n    raise ValueError('bad batch on rank 0')\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    failed_at = time.monotonic()
    assert not run.ok
    # ended by the failure, not the 30 s timeout: the desync grace, then a release, with slack for
    # dispatch and a slow release (the 4-rank case took 5.03 s under a full CI on 2 cores).
    bound = DESYNC_GRACE + 2 * INTERRUPT_GRACE
    assert run.elapsed < bound, f"the cell took {run.elapsed:.1f} s; it should end within {bound:g} s"
    text = run.error_text()
    headline = "rank 0 failed first: ValueError: bad batch on rank 0 (also failed: rank 1)"
    assert text.splitlines()[0] == headline
    raised = text.index("──── rank 0: ValueError: bad batch on rank 0 ────")
    waited = text.index(
        "──── rank 1: RuntimeError: left waiting in all_reduce; released by closing the process group "
        "on rank 0 ────"
    )
    assert raised < waited, "the raising rank's traceback comes first"
    assert "the next cell first rebuilds the group (rank state is kept)" in text
    notices = _recovered_with_state(kernel, failed_at)
    assert "out of step" not in notices, "every rank failed: no partial-failure warning"


def test_f4_a_straggler_skips_the_collective(kernel: Any) -> None:
    _start(kernel)
    skips = "if shard.rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
    run = kernel.execute(f"%%distributed --timeout 30\n{skips}")
    failed_at = time.monotonic()
    assert not run.ok
    assert run.elapsed < 10.0, f"the cell took {run.elapsed:.1f} s, not ended early by the desync check"
    text = run.error_text()
    assert "rank 0 waited in all_reduce for rank 1, which finished the cell without joining it" in text
    assert "──── rank 0: RuntimeError: left waiting in all_reduce" in text
    notices = _recovered_with_state(kernel, failed_at)
    assert "the last cell failed on rank 0 only, so the ranks may be out of step" in notices
    assert "%dist_restart gives fresh ranks" in notices


@pytest.mark.parametrize("after", [0.3, 2.5], ids=["before-a-heartbeat", "after-a-heartbeat"])
def test_f6_interrupt_while_one_rank_sleeps_and_the_other_waits_in_all_reduce(
    kernel: Any, after: float
) -> None:
    """At 2.5 s a heartbeat has shown rank 1 in all_reduce: it gets no SIGINT, only the release. At
    0.3 s usually none has: both get SIGINT, and rank 1, still running 2 s later, is released."""
    _start(kernel)
    pids = rank_pids(kernel)
    fired = interrupt_after(kernel, after)
    run = kernel.execute(
        "%%distributed\nif shard.rank == 0:\n    time.sleep(60)\ndist.all_reduce(torch.ones(1))\n"
    )
    fired.join()
    failed_at = time.monotonic()
    assert not run.ok
    assert run.elapsed < after + 10.0, f"the cell took {run.elapsed:.1f} s"
    notices = run.stream()
    assert "interrupted: sending SIGINT" in notices
    assert (
        "rank 1 is blocked in" in notices and "closing the process group on rank 0 to release it" in notices
    )
    text = run.error_text()
    assert "──── rank 0: KeyboardInterrupt ────" in text
    assert "──── rank 1: RuntimeError: left waiting in" in text or "──── rank 1: KeyboardInterrupt" in text
    assert "killed" not in notices
    _recovered_with_state(kernel, failed_at)
    assert sorted(rank_pids(kernel)) == sorted(pids), "the ranks were kept, not respawned"


def test_f6_ranks_all_blocked_are_killed_within_10s_and_replaced(kernel: Any) -> None:
    _start(kernel)
    pids = rank_pids(kernel)
    fired = interrupt_after(kernel, 2.5)
    # Each rank waits to receive from the other: nobody is idle to release them.
    run = kernel.execute("%%distributed\nt = torch.zeros(1)\ndist.recv(t, src=1 - shard.rank)\n")
    fired.join()
    failed_at = time.monotonic()
    assert not run.ok
    assert run.elapsed < 2.5 + 10.0, f"the cell took {run.elapsed:.1f} s"
    notices = run.stream()
    assert "rank 0-1 still running: sending SIGINT" in notices
    assert "killed rank 0-1 (still running 4 s after it was asked to stop)" in notices
    text = run.error_text()
    assert "its stack before it was killed" in text and "in recv" in text
    deadline = time.monotonic() + 2.0
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(pids) == [], "killed ranks are reaped, no zombies"
    nxt = kernel.execute("%%distributed\n'kept' in dir()")
    back = time.monotonic() - failed_at
    assert back < 5.0, f"back to a working cell {back:.1f} s after the failing cell ended"
    assert "restarting the pool (rank 0-1 was killed); rank state is lost" in nxt.stream()
    assert nxt.data("execute_result") == [{"text/plain": "False"}]


def test_f9_a_rank_spinning_in_python_past_the_timeout_is_shown_with_its_stack(kernel: Any) -> None:
    _start(kernel)
    run = kernel.execute(
        "%%distributed --timeout 5\nif shard.rank == 1:\n    while True:\n        pass\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    failed_at = time.monotonic()
    assert not run.ok
    assert 5.0 <= run.elapsed < 5.0 + 6.0, f"the cell took {run.elapsed:.1f} s"
    notices = run.stream()
    assert "rank 1 still running after the 5 s timeout: sending SIGINT" in notices
    text = run.error_text()
    spinning = text[text.index("──── rank 1: KeyboardInterrupt ────") :]
    assert "----> 3     while True:" in spinning or "----> 4         pass" in spinning, spinning
    assert "──── rank 0: RuntimeError: left waiting in all_reduce" in text
    _recovered_with_state(kernel, failed_at)


def test_status_names_the_collective_and_stacks_work_during_a_background_run(kernel: Any) -> None:
    _start(kernel)
    started = kernel.execute(
        "%%distributed --bg\nif shard.rank == 0:\n    time.sleep(30)\ndist.all_reduce(torch.ones(1))\n"
    )
    assert started.ok, started.error_text()
    # Until rank 1's heartbeats name the collective a second apart: it is then waiting inside it (in
    # gloo's C++ wait, where an interrupt cannot reach it), not still entering it.
    deadline, first_seen = time.monotonic() + 15.0, None
    while True:
        status = _shown(kernel.execute("%dist_status"))
        row = next(line for line in status.splitlines() if line.startswith("1 "))
        now = time.monotonic()
        first_seen = (first_seen or now) if "in all_reduce" in row else None
        if (first_seen is not None and now - first_seen >= 1.0) or now > deadline:
            break
        time.sleep(0.1)
    assert "in all_reduce" in row, status
    stacks = _shown(kernel.execute("%dist_stacks"))
    assert "time.sleep(30)" in stacks and "dist.all_reduce(torch.ones(1))" in stacks, stacks
    stopped = kernel.execute("%dist_interrupt")
    assert stopped.ok, stopped.error_text()
    waited = kernel.execute("%dist_wait")
    failed_at = time.monotonic()
    assert not waited.ok
    assert "left waiting in all_reduce" in waited.error_text()
    _recovered_with_state(kernel, failed_at)
