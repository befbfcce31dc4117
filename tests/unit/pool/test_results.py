"""jupyter_shard.pool.results: RunResult, failure ordering and the DistributedError message."""

from __future__ import annotations

from jupyter_shard.pool.results import DistributedError, RankResult, RunResult


def _tb(rank: int) -> list[str]:
    return [
        "Traceback (most recent call last):",
        f'  File "<cell>", line {rank + 1}',
        f"Err{rank}: from rank {rank}",
    ]


def _failed(rank: int, at: float, ename: str = "RuntimeError", evalue: str = "boom") -> RankResult:
    return RankResult(rank, status="error", ename=ename, evalue=evalue, traceback=_tb(rank), failed_at=at)


def test_ok_run() -> None:
    r = RunResult("c1", {0: RankResult(0, status="ok"), 1: RankResult(1, status="ok")})
    assert r.ok
    assert r.failures() == []
    assert r.value is None


def test_value_is_the_lowest_ranks_result() -> None:
    r = RunResult(
        "c1",
        {
            2: RankResult(2, status="ok", result={"text/plain": "2"}),
            1: RankResult(1, status="ok", result={"text/plain": "1"}),
            0: RankResult(0, status="ok"),
        },
    )
    assert r.value == {"text/plain": "1"}
    r.ranks[0].result = {"text/plain": "0"}
    assert r.value == {"text/plain": "0"}


def test_failures_are_ordered_by_failed_at_then_rank() -> None:
    r = RunResult(
        "c",
        {
            0: _failed(0, at=30.0),
            1: RankResult(1, status="ok"),
            2: _failed(2, at=10.0),
            3: _failed(3, at=20.0),
            4: RankResult(4, status="interrupted"),  # never recorded a failure time: last
        },
    )
    assert not r.ok
    assert [f.rank for f in r.failures()] == [2, 3, 0, 4]


def test_distributed_error_names_first_failing_rank_first_and_lists_the_others() -> None:
    r = RunResult(
        "c",
        {
            0: _failed(0, at=5.0, ename="RuntimeError", evalue="collective timed out"),
            1: _failed(1, at=2.0, ename="ValueError", evalue="bad shape"),
            2: RankResult(2, status="ok"),
            3: _failed(3, at=7.0),
        },
    )
    err = DistributedError(r)
    assert err.rank == 1
    assert err.headline == "rank 1 failed first: ValueError: bad shape (also failed: rank 0,3)"
    assert err.args == (err.headline,)
    assert list(err.tracebacks) == [1, 0, 3]
    assert err.tracebacks[1] == _tb(1)


def test_also_failed_uses_compact_rank_ranges() -> None:
    r = RunResult("c", {k: _failed(k, at=float(10 - k)) for k in range(5)})
    assert DistributedError(r).headline.endswith("(also failed: rank 0-3)")
    assert DistributedError(r).rank == 4


def test_single_failure_has_no_also_clause() -> None:
    err = DistributedError(RunResult("c", {0: RankResult(0, status="ok"), 1: _failed(1, at=1.0)}))
    assert err.headline == "rank 1 failed first: RuntimeError: boom"


def test_all_interrupted_headline() -> None:
    r = RunResult(
        "c",
        {k: RankResult(k, status="interrupted", ename="KeyboardInterrupt", failed_at=1.0) for k in range(3)},
    )
    assert DistributedError(r).headline == "interrupted: KeyboardInterrupt on rank 0-2"


def test_dead_rank_summary_and_empty_evalue() -> None:
    dead = RankResult(0, status="dead", evalue="rank 0 exited with code 3", failed_at=1.0)
    interrupted = RankResult(1, status="interrupted", ename="KeyboardInterrupt", failed_at=2.0)
    err = DistributedError(RunResult("c", {0: dead, 1: interrupted}))
    assert err.headline == "rank 0 failed first: rank 0 exited with code 3 (also failed: rank 1)"
    assert "──── rank 1: KeyboardInterrupt ────" in err.render()


def test_render_includes_every_traceback_root_cause_first_and_notes() -> None:
    r = RunResult("c", {0: _failed(0, at=3.0), 1: _failed(1, at=1.0), 2: _failed(2, at=2.0)})
    r.notes.append("ranks 0 and 2 were left waiting in all_reduce")
    err = DistributedError(r)
    lines = err.render()
    assert lines[0] == err.headline
    assert lines[1] == "ranks 0 and 2 were left waiting in all_reduce"
    for k in range(3):
        for line in _tb(k):
            assert line in lines
    sections = [lines.index(f"──── rank {k}: RuntimeError: boom ────") for k in (1, 2, 0)]
    assert sections == sorted(sections)
    assert (
        lines.index("Err1: from rank 1") < lines.index("Err2: from rank 2") < lines.index("Err0: from rank 0")
    )
    assert str(err) == "\n".join(lines)


def test_custom_headline_and_no_failures() -> None:
    err = DistributedError(
        RunResult("c", {0: RankResult(0, status="ok")}), headline="cell timed out after 5 s"
    )
    assert err.headline == "cell timed out after 5 s"
    assert err.rank == -1
    assert DistributedError(RunResult("c", {})).headline == "the cell failed"


def test_a_dead_rank_comes_before_the_peer_whose_collective_it_broke() -> None:
    gloo = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    dead = RankResult(1, status="dead", evalue="rank 1 exited with code 3", failed_at=10.2)
    r = RunResult("c", {0: _failed(0, at=10.0, evalue=gloo), 1: dead})
    assert [f.rank for f in r.failures()] == [1, 0]
    assert DistributedError(r).headline.startswith("rank 1 failed first: rank 1 exited with code 3")
    # without a death, a closed connection is just the first failure
    alive = RunResult("c", {0: _failed(0, at=10.0, evalue=gloo), 1: _failed(1, at=10.2)})
    assert [f.rank for f in alive.failures()] == [0, 1]
