"""jupyter_shard.pool.results: RunResult, failure ordering and the DistributedError message."""

from __future__ import annotations

import random
import re

from jupyter_shard.pool.results import MESSAGES_SHOWN, DistributedError, RankResult, RunResult


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


# -- tracebacks grouped by where they were raised ------------------------------------------------------

_FRAMES = [
    "---------------------------------------------------------------------------",
    "ValueError                                Traceback (most recent call last)",
    "Cell In[2], line 2\n----> 2 f(dist.get_rank())\n",
    'Cell In[1], line 2, in f(r)\n----> 2     raise ValueError(f"bad {r}")\n',
]


def _raised(
    rank: int, at: float, message: str, frames: list[str] = _FRAMES, ename: str = "ValueError"
) -> RankResult:
    colour = "\x1b[0;31m" if rank % 2 else ""  # IPython colours the exception line in a notebook
    line = f"{colour}{ename}{chr(27) + '[0m' if colour else ''}: {message}"
    tb = [*frames, line]
    return RankResult(rank, status="error", ename=ename, evalue=message, traceback=tb, failed_at=at)


def test_64_ranks_raising_one_error_with_their_own_messages_read_as_one_block() -> None:
    order = list(range(64))
    random.Random(7).shuffle(order)  # arrival order is not rank order
    ranks = {rank: _raised(rank, at=1.0 + i, message=f"bad {rank}") for i, rank in enumerate(order)}
    lines = DistributedError(RunResult("c", ranks)).render()
    assert lines[0].startswith(
        f"rank {order[0]} failed first: ValueError: bad {order[0]} (also failed: rank "
    )
    assert lines[1] == "──── rank 0-63: ValueError, 64 different messages ────"
    assert lines[2:6] == _FRAMES  # the frames once
    messages = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines[6:]]
    assert messages == [
        "[rank 0] ValueError: bad 0",
        "[rank 1] ValueError: bad 1",
        "[rank 2] ValueError: bad 2",
        "… 60 more different messages, on rank 3-62 (each rank's log has its own)",
        "[rank 63] ValueError: bad 63",
    ]
    assert len(lines) == 11  # against 64 blocks of 6 lines before


def test_a_lone_rank_failing_elsewhere_stands_out_first() -> None:
    elsewhere = [*_FRAMES[:2], "Cell In[2], line 9\n----> 9 load(shard)\n"]
    ranks = {rank: _raised(rank, at=10.0 + rank, message="the same on all") for rank in range(8) if rank != 5}
    ranks[5] = _raised(5, at=1.0, message="no such file: shard-5", frames=elsewhere, ename="OSError")
    lines = DistributedError(RunResult("c", ranks)).render()
    assert lines[0] == "rank 5 failed first: OSError: no such file: shard-5 (also failed: rank 0-4,6-7)"
    assert lines[1] == "──── rank 5: OSError: no such file: shard-5 ────"
    assert lines[2:5] == elsewhere
    assert lines[6] == "──── rank 0-4,6-7: ValueError: the same on all ────"  # one message: as one traceback
    assert lines[7:] == ranks[0].traceback


def test_ranks_sharing_a_message_share_its_line() -> None:
    ranks = {rank: _raised(rank, at=rank, message=f"bad shard {rank // 4}") for rank in range(12)}
    lines = DistributedError(RunResult("c", ranks)).render()
    clean = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
    assert clean[1] == "──── rank 0-11: ValueError, 3 different messages ────"
    assert clean[-3:] == [
        "[rank 0-3] ValueError: bad shard 0",
        "[rank 4-7] ValueError: bad shard 1",
        "[rank 8-11] ValueError: bad shard 2",
    ]


def test_every_failed_rank_is_in_exactly_one_block_and_every_message_is_shown_or_counted() -> None:
    """Random pools of failures: places drawn from a few, messages from a few per place."""
    rng = random.Random(11)
    for _ in range(200):
        world = rng.randint(1, 80)
        places = [[*_FRAMES[:2], f"Cell In[2], line {p}\n"] for p in range(rng.randint(1, 3))]
        ranks = {}
        for rank in rng.sample(range(world), rng.randint(1, world)):
            place = rng.randrange(len(places))
            ranks[rank] = _raised(rank, rng.random(), f"m{place}-{rng.randint(0, 6)}", places[place])
        lines = DistributedError(RunResult("c", ranks)).render()
        headers = [line for line in lines if line.startswith("──── rank ")]
        covered = [r for h in headers for r in _ranks_of(h.split(": ", 1)[0].removeprefix("──── rank "))]
        assert sorted(covered) == sorted(ranks)
        text = "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines)
        folded = [
            r
            for line in text.splitlines()
            if line.startswith("… ")
            for r in _ranks_of(line.split(" on rank ")[1].split(" (")[0])
        ]
        for rank, failure in ranks.items():
            assert f"ValueError: {failure.evalue}" in text or rank in folded
        assert len(lines) <= 1 + len(headers) * (len(_FRAMES) + 2 + MESSAGES_SHOWN)


def _ranks_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_an_lstm_that_onednn_cannot_run_in_low_precision_gets_one_line_saying_what_to_do() -> None:
    """torch's own message (an AMD EPYC without AVX-512, bf16-mixed) names a oneDNN primitive and no
    way out; the error gains one hint line, once however many ranks raised it."""
    onednn = "could not create a primitive descriptor for the LSTM forward propagation primitive"
    r = RunResult("c", {k: _failed(k, at=float(k), evalue=onednn) for k in range(4)})
    lines = DistributedError(r).render()
    hint = [line for line in lines if line.startswith("hint: ")]
    assert hint == [
        "hint: this CPU's oneDNN has no LSTM kernel in autocast's low precision: run with --precision 32, "
        "or call the LSTM under torch.autocast('cpu', enabled=False) with a float32 input"
    ]
    assert lines.index(hint[0]) == 1  # under the headline, before the tracebacks
    other = RunResult("c", {0: _failed(0, at=0.0, evalue="could not create a primitive descriptor for conv")})
    assert not any(line.startswith("hint: ") for line in DistributedError(other).render())
