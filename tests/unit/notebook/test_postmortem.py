"""``%debug`` after a failed ``%%distributed`` cell and ``%dist_debug --rank K``, with a stand-in pool:
which failure is remembered, when IPython's own ``%debug`` runs instead, and what is refused."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

from jupyter_shard.notebook.postmortem import PostMortem
from jupyter_shard.pool.results import DistributedError, RankResult, RunResult


def _failure(*failed: int, world: int = 2) -> DistributedError:
    ranks = {k: RankResult(k, "ok") for k in range(world)}
    for order, k in enumerate(failed):
        ranks[k] = RankResult(
            k, "error", ename="ValueError", evalue="bad", traceback=["tb"], failed_at=order + 1
        )
    return DistributedError(RunResult("c1", ranks))


class _Pool:
    def __init__(self, last: RunResult | None, world: int = 2, started: bool = True) -> None:
        self.started = started
        self.last_result = last
        self.world_size = world
        self.ranks = [SimpleNamespace(rank=k) for k in range(world)]
        self.opened: list[int] = []

    def post_mortem(self, rank: int) -> None:
        self.opened.append(rank)
        self.last_result = RunResult("post-mortem", {rank: RankResult(rank, "ok")})


def _result(error: BaseException | None) -> ExecutionResult:
    result = ExecutionResult(ExecutionInfo("x", False, False, True, None))
    result.error_in_exec = error
    return result


class _Original:
    """IPython's ``%debug``, as the wrapper finds it."""

    __doc__ = "IPython's debug."

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> str:
        self.calls.append(args)
        return "ipython"


@pytest.fixture
def installed(
    ipython: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[PostMortem, _Pool, _Original]]:
    original = _Original()
    monkeypatch.setitem(ipython.magics_manager.magics["line"], "debug", original)
    pool = _Pool(None)
    post = PostMortem(ipython, lambda: pool)
    post.install()
    yield post, pool, original
    post.uninstall()


def test_a_failed_distributed_cell_is_remembered_until_a_local_failure(
    installed: tuple[PostMortem, _Pool, _Original],
) -> None:
    post = installed[0]
    events = post.shell.events
    error = _failure(1)
    events.trigger("post_run_cell", _result(error))
    assert post.failure is error
    events.trigger("post_run_cell", _result(None))  # a cell that worked: the last failure stays
    assert post.failure is error
    events.trigger("post_run_cell", _result(UsageError("bad option")))  # a mistyped magic is no failed cell
    assert post.failure is error
    events.trigger("post_run_cell", _result(ZeroDivisionError()))
    assert post.failure is None


def test_a_bare_debug_after_a_distributed_failure_opens_the_first_failing_rank(
    installed: tuple[PostMortem, _Pool, _Original], capsys: pytest.CaptureFixture[str]
) -> None:
    post, pool, original = installed
    error = _failure(1, 0)
    pool.last_result = error.result
    post.failure = error
    post.shell.run_line_magic("debug", "")
    assert pool.opened == [1] and original.calls == []
    assert "pdb on rank 1, where its part of the cell raised (q: quit)" in capsys.readouterr().out


def test_debug_with_arguments_or_after_a_local_failure_is_ipythons(
    installed: tuple[PostMortem, _Pool, _Original],
) -> None:
    post, pool, original = installed
    post.failure = _failure(1)
    pool.last_result = post.failure.result
    assert post.shell.run_line_magic("debug", "--breakpoint x.py:1") == "ipython"
    post.failure = None
    assert post.shell.run_line_magic("debug", "") == "ipython"
    assert original.calls == [("--breakpoint x.py:1",), ("",)] and pool.opened == []


def test_the_wrapper_says_what_it_adds_and_installing_twice_wraps_once(
    installed: tuple[PostMortem, _Pool, _Original],
) -> None:
    post, _, original = installed
    wrapper = post.shell.magics_manager.magics["line"]["debug"]
    assert wrapper.__doc__.startswith("IPython's debug.") and "%dist_debug --rank K" in wrapper.__doc__
    post.install()
    assert post.shell.magics_manager.magics["line"]["debug"] is wrapper
    post.uninstall()
    assert post.shell.magics_manager.magics["line"]["debug"] is original
    post.shell.events.trigger("post_run_cell", _result(_failure(0)))
    assert post.failure is None  # no longer listening
    post.uninstall()  # twice: nothing left to undo


@pytest.mark.parametrize("pool", [None, _Pool(None, started=False)], ids=["no-pool", "stopped"])
def test_no_running_pool_is_refused(ipython: InteractiveShell, pool: _Pool | None) -> None:
    post = PostMortem(ipython, lambda: pool)
    post.failure = _failure(0)
    with pytest.raises(
        UsageError, match="no pool is running: %dist_debug opens pdb on a rank after a failed"
    ):
        post.open(None)


def test_a_traceback_the_ranks_no_longer_keep_is_refused(ipython: InteractiveShell) -> None:
    error = _failure(0)
    pool = _Pool(RunResult("later", {}))  # another cell ran since
    post = PostMortem(ipython, lambda: pool)
    post.failure = error
    with pytest.raises(UsageError, match="keep a failed cell's traceback only until their next cell"):
        post.open(None)
    post.failure = None
    with pytest.raises(UsageError, match="run the failing cell again"):
        post.open(0)
    assert pool.opened == []


def test_a_rank_outside_the_pool_or_that_did_not_fail_is_refused(ipython: InteractiveShell) -> None:
    error = _failure(1, world=3)
    pool = _Pool(error.result, world=3)
    post = PostMortem(ipython, lambda: pool)
    post.failure = error
    with pytest.raises(UsageError, match=r"^--rank 5 is not a rank of this pool \(0-2\)$"):
        post.open(5)
    with pytest.raises(UsageError, match=r"^rank 2 did not fail in the last cell \(failed: rank 1\)$"):
        post.open(2)
    assert pool.opened == []


def test_another_failing_rank_can_be_opened_after_a_post_mortem_session(ipython: InteractiveShell) -> None:
    error = _failure(0, 1)
    pool = _Pool(error.result)
    post = PostMortem(ipython, lambda: pool)
    post.failure = error
    post.open(None)
    assert pool.last_result is not error.result  # the session's own cell ran on the ranks
    post.open(1)
    post.open(0)
    assert pool.opened == [0, 1, 0]
