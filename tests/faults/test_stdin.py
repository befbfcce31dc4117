"""F18 at 2, 3 and 4 ranks: a rank calls ``breakpoint()`` or ``input()`` where the frontend allows no
stdin (nbclient, nbval: the execute request has ``allow_stdin`` false). It fails at once with a message
that says how to look instead, the ranks waiting for it in a collective are released, and a working
cell follows within 5 s with every rank's state kept."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.faults.conftest import back_to_work, rank_pids

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("nproc", [2, 3, 4])]

SETUP = "%%distributed --nproc {nproc} --device cpu\nimport torch, torch.distributed as dist\nkept = 41"


def test_f18_breakpoint_without_stdin_fails_fast_while_the_others_wait(kernel: Any, nproc: int) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(SETUP.format(nproc=nproc)).ok
    pids = rank_pids(kernel)
    last = nproc - 1
    code = f"if shard.rank == {last}:\n    breakpoint()\ndist.all_reduce(torch.ones(1))\n"
    run = kernel.execute("%%distributed --timeout 30\n" + code)
    failed_at = time.monotonic()
    assert not run.ok
    # The rank fails at once; the others are released as after any rank's error (3 s of grace, then
    # the release), far inside the --timeout a prompt left waiting would run into.
    assert run.elapsed < 10.0, f"the cell took {run.elapsed:.1f} s; a prompt no one sees must not wait"
    text = run.error_text()
    assert text.splitlines()[0].startswith(
        f"rank {last} failed first: StdinNotImplementedError: pdb on rank {last}"
    )
    assert "does not answer input requests" in text and "%dist_stacks" in text
    back_to_work(kernel, nproc, failed_at, pids)


def test_f18_input_on_every_rank_without_stdin_fails_fast(kernel: Any, nproc: int) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(SETUP.format(nproc=nproc)).ok
    run = kernel.execute("%%distributed --timeout 30\nanswer = input('continue? ')")
    assert not run.ok
    assert run.elapsed < 10.0, f"the cell took {run.elapsed:.1f} s"
    assert "input() on rank" in run.error_text() and "Pool(stdin=...)" in run.error_text()
    nxt = kernel.execute("%%distributed\nprint('kept', kept + 1)")
    assert nxt.ok and all(f"[rank {k}] kept 42" in nxt.stream() for k in range(nproc))
