"""Stopping to look at a rank from the notebook: ``input()`` and pdb on a rank through Jupyter's stdin
channel, ``%debug`` after a failed cell, and the fast failure where no one can answer. Driven through
a real kernel whose client answers input requests as JupyterLab does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Kernel

pytestmark = pytest.mark.timeout(240)


def answers(*lines: str) -> Any:
    it: Iterator[str] = iter(lines)

    def answer(prompt: str, password: bool) -> str:
        return next(it)

    return answer


@pytest.fixture(scope="module")
def dk(shared_kernel: Kernel) -> Kernel:
    """A kernel with a 2-rank CPU pool."""
    assert shared_kernel.execute("%load_ext jupyter_shard").ok
    assert shared_kernel.execute("%%distributed --nproc 2 --device cpu\npass").ok
    return shared_kernel


def test_input_on_one_rank_is_asked_with_its_rank_named_and_answers_only_it(dk: Kernel) -> None:
    code = (
        "%%distributed\nv = input('favourite number? ') if shard.rank == 1 else 'not asked'\nprint('got', v)"
    )
    run = dk.execute(code, stdin=answers("7"))
    assert run.ok, run.outputs
    assert run.prompts == ["[rank 1] favourite number? "]
    out = run.stream()
    assert "[rank 1] got 7" in out and "[rank 0] got not asked" in out
    assert "[rank 1] favourite number? 7" in out  # the exchange in the rank's own output


def test_ranks_asking_at_once_are_asked_one_after_the_other_in_rank_order(dk: Kernel) -> None:
    run = dk.execute("%%distributed\nname = input('name? ')\nname", stdin=answers("zero", "one"))
    assert run.ok, run.outputs
    assert run.prompts == ["[rank 0] name? ", "[rank 1] name? "]
    assert run.data("execute_result")[0]["text/plain"] == "[rank 0] 'zero'\n[rank 1] 'one'"


def test_breakpoint_on_one_rank_is_a_pdb_session_in_the_notebook(dk: Kernel) -> None:
    code = (
        "%%distributed\n"
        "def step(x):\n"
        "    if shard.rank == 1:\n"
        "        breakpoint()\n"
        "    y = x * 2\n"
        "    return y\n"
        "r = step(20 + shard.rank)\n"
        "r"
    )
    run = dk.execute(code, stdin=answers("p x", "n", "p y", "c"))
    assert run.ok, run.outputs
    assert run.prompts == ["[rank 1] (Pdb) "] * 4
    out = run.stream()
    assert "[rank 1] (Pdb) p x\n[rank 1] 21\n" in out
    assert "[rank 1] (Pdb) p y\n[rank 1] 42\n" in out  # after `n` ran `y = x * 2`
    assert "[rank 1] -> return y" in out
    shown = run.data("execute_result")[0]["text/plain"]
    assert "[rank 0] 40" in shown and "[rank 1] 42" in shown


def test_pythonbreakpoint_is_honoured(dk: Kernel) -> None:
    run = dk.execute(
        "%%distributed\nimport os\nos.environ['PYTHONBREAKPOINT'] = '0'\nbreakpoint()\n"
        "del os.environ['PYTHONBREAKPOINT']\n'passed'",
        stdin=answers(),
    )
    assert run.ok, run.outputs
    assert run.prompts == []


def test_debug_after_a_failed_cell_opens_the_first_failing_ranks_frame(dk: Kernel) -> None:
    failed = dk.execute(
        "%%distributed\ndef f(v):\n    scale = 10 + shard.rank\n    return scale / v\nf(shard.rank - 1)"
    )
    assert not failed.ok and "ZeroDivisionError" in failed.error_text()
    run = dk.execute("%debug", stdin=answers("p scale", "p v", "q"))
    assert run.ok, run.outputs
    assert run.prompts and all(p.startswith("[rank 1] ") for p in run.prompts)
    out = run.stream()
    assert "pdb on rank 1" in out
    assert "p scale\n[rank 1] 11\n" in out and "p v\n[rank 1] 0\n" in out
    # A second look, at the same failure, stays possible until the ranks run another cell.
    again = dk.execute("%dist_debug --rank 1", stdin=answers("p scale", "q"))
    assert again.ok and "p scale\n[rank 1] 11\n" in again.stream()
    other = dk.execute("%dist_debug --rank 0")
    assert not other.ok and "rank 0 did not fail in the last cell" in other.stream("stderr")
    assert dk.execute("%%distributed\nx = 1").ok
    gone = dk.execute("%dist_debug")
    assert not gone.ok and "only until their next cell" in gone.stream("stderr")


def test_dist_debug_rank_opens_another_failed_ranks_frame(dk: Kernel) -> None:
    failed = dk.execute("%%distributed\nwho = shard.rank * 100\nraise ValueError(f'bad {who}')")
    assert not failed.ok
    run = dk.execute("%dist_debug --rank 1", stdin=answers("p who", "q"))
    assert run.ok and "[rank 1] 100" in run.stream()


def test_debug_after_a_local_exception_is_ipythons(dk: Kernel) -> None:
    assert not dk.execute("%%distributed\n1 / 0").ok
    assert not dk.execute("local_value = 5\nraise KeyError(local_value)").ok
    run = dk.execute("%debug", stdin=answers("p local_value", "q"))
    assert run.ok
    assert run.prompts and not run.prompts[0].startswith("[rank")  # the kernel's own pdb
    assert "5" in run.stream()


def test_without_stdin_input_and_breakpoint_fail_at_once_saying_what_to_do(dk: Kernel) -> None:
    started = time.monotonic()
    run = dk.execute("%%distributed\ninput('anyone? ')")
    took = time.monotonic() - started
    assert not run.ok
    assert "StdinNotImplementedError" in run.error_text()
    assert "does not answer input requests" in run.error_text() and "Pool(stdin=...)" in run.error_text()
    assert took < 10, took  # a failure, not a hang
    run = dk.execute("%%distributed\nif shard.rank == 1:\n    breakpoint()")
    assert not run.ok and "pdb on rank 1 needs the notebook's input box" in run.error_text()
    assert "%dist_stacks" in run.error_text()
    assert dk.execute("%%distributed\nshard.rank").ok  # the pool is usable


def test_an_interrupt_at_a_pdb_prompt_ends_the_cell_and_the_pool_works(dk: Kernel) -> None:
    asked: list[float] = []

    def leave_it(prompt: str, password: bool) -> None:
        asked.append(time.monotonic())
        threading.Timer(0.5, dk.km.interrupt_kernel).start()
        return None

    run = dk.execute("%%distributed\nif shard.rank == 1:\n    breakpoint()\n'done'", stdin=leave_it)
    ended = time.monotonic()
    assert asked and not run.ok
    assert ended - asked[0] - 0.5 < 2.0, ended - asked[0]
    status = dk.execute("%dist_status").data("execute_result")[0]["text/plain"]
    assert "at a prompt" not in status
    assert dk.execute("%%distributed\nshard.rank").ok


def test_a_timeout_ends_a_cell_whose_rank_waits_at_a_prompt(dk: Kernel) -> None:
    run = dk.execute("%%distributed --timeout 2\ninput('slow? ')", stdin=lambda p, pw: None)
    assert not run.ok and "timed out after 2 s" in run.error_text()
    assert dk.execute("%%distributed\nshard.rank").ok


def test_a_background_run_says_it_waits_and_dist_wait_asks(dk: Kernel) -> None:
    started = dk.execute("%%distributed --bg\nv = input('bg? ') if shard.rank == 0 else 'x'\nv")
    assert started.ok
    said = dk.drain(3.0)
    text = "".join(m["content"].get("text", "") for m in said if m["msg_type"] == "stream")
    assert "rank 0 is waiting at a prompt (bg?): %dist_wait shows it" in text
    status = dk.execute("%dist_status").data("execute_result")[0]["text/plain"]
    row = next(line for line in status.splitlines() if line.startswith("0 "))
    assert "at a prompt" in row and "at bg?" in row, status
    run = dk.execute("%dist_wait", stdin=answers("later"))
    assert run.ok, run.outputs
    assert run.prompts == ["[rank 0] bg? "]
    assert "[rank 0] 'later'" in run.data("execute_result")[0]["text/plain"]
