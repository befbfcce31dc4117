"""The Python API (``jupyter_shard.Pool``) with real ranks: the same machinery as the magics."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard import DistributedError, Pool, PoolError
from jupyter_shard.pool.output import ConsoleSink

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    out, err = io.StringIO(), io.StringIO()
    with Pool(
        nproc=2,
        device="cpu",
        strategy="ddp",
        log_dir=tmp_path_factory.mktemp("logs"),
        sink=ConsoleSink(out, err),
    ) as p:
        yield p


def test_run_returns_per_rank_results(pool: Pool) -> None:
    result = pool.run("print('hello from', shard.rank)\nshard.rank * 10")
    assert result.ok
    assert result.ranks[0].stdout == "hello from 0\n" and result.ranks[1].stdout == "hello from 1\n"
    assert result.value == {"text/plain": "0"}
    assert result.ranks[1].result == {"text/plain": "10"}


def test_distributed_error_carries_every_traceback_root_cause_first(pool: Pool) -> None:
    with pytest.raises(DistributedError) as caught:
        pool.run("import time\nif shard.rank == 0:\n    time.sleep(0.3)\nraise KeyError(shard.rank)")
    err = caught.value
    assert err.rank == 1
    assert sorted(err.tracebacks) == [0, 1]
    assert "KeyError: 1" in "\n".join(err.tracebacks[1])
    assert str(err).startswith("rank 1 failed first: KeyError: 1 (also failed: rank 0)")


def test_stacks_mid_cell_from_another_thread(pool: Pool) -> None:
    seen: dict[int, str] = {}

    def ask() -> None:
        time.sleep(1.0)
        seen.update(pool.stacks())

    asker = threading.Thread(target=ask)
    asker.start()
    pool.run("import time\ndef deep_in_training():\n    time.sleep(2.5)\ndeep_in_training()")
    asker.join()
    assert sorted(seen) == [0, 1]
    for text in seen.values():
        assert text.startswith("MainThread:")
        assert "in deep_in_training" in text and "time.sleep(2.5)" in text


def test_status_while_idle(pool: Pool) -> None:
    rows = pool.status()
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.state.value == "idle" and r.memory["rss"] > 50 * 2**20 for r in rows)
    assert all(Path(r.log_path).is_file() for r in rows)


def test_push_pull_and_missing_ranks(pool: Pool) -> None:
    pool.push(scale=3)
    pool.run("scaled = scale * (shard.rank + 1)")
    assert pool.pull_all("scaled") == {0: 3, 1: 6}
    assert pool.pull("scaled", rank=1) == 6
    with pytest.raises(PoolError, match="rank 5 does not exist: the pool has 2 ranks"):
        pool.run("1", ranks=[5])


def test_push_takes_a_dict_as_ipyparallel_does_and_ranks_by_keyword(pool: Pool) -> None:
    pool.push({"a": 1, "ranks": "a variable called ranks"}, b=2)
    pool.push(a=10, ranks=[1])
    assert pool.pull_all("a") == {0: 1, 1: 10}
    assert pool.pull("ranks", rank=1) == "a variable called ranks" and pool.pull("b", rank=0) == 2
    with pytest.raises(TypeError, match=r"pool.push\(x=value\) or pool.push\(\{'x': value\}\)"):
        pool.push([0, 1])  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="cannot push under 'not a name', 3: each name must be"):
        pool.push({"not a name": 1, 3: 2})  # type: ignore[dict-item]


def test_interrupt_from_another_thread_reaches_running_ranks(pool: Pool) -> None:
    def later() -> None:
        time.sleep(1.0)
        pool.interrupt()

    threading.Thread(target=later).start()
    started = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        pool.run("import time\nwhile True:\n    time.sleep(0.01)")
    assert time.monotonic() - started < 3.0
    assert caught.value.headline == "interrupted: KeyboardInterrupt on rank 0-1"
    assert pool.run("'alive'").value == {"text/plain": "'alive'"}


_NO_UI = """
import sys
from jupyter_shard import Pool
with Pool(nproc=1, device="cpu") as pool:
    assert pool.run("6 * 7").value == {"text/plain": "42"}
loaded = sorted(m for m in sys.modules if m.startswith(("jupyter_shard.notebook", "ipywidgets")))
print("UI modules:", loaded)
"""


def test_a_pool_driven_from_a_script_loads_no_ui_module(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "JUPYTER_SHARD_LOG_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _NO_UI], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "UI modules: []" in done.stdout, done.stdout


# -- the local ranks' direct links (jupyter_shard/pool/links.py) ---------------------------------


def _rank_log(pool: Pool, rank: int) -> str:
    assert pool.log_dir is not None
    return (pool.log_dir / f"rank-{rank}.log").read_text(errors="replace")


def test_a_rank_whose_link_closes_goes_on_over_the_socket(pool: Pool) -> None:
    links = pool.connection.links
    assert links.serves(0) and links.serves(1)
    with pool.connection.lock:
        links._drop(links._by_rank[0])  # as when the link fails on the kernel's side
    assert not links.serves(0)
    for _ in range(3):
        result = pool.run("print('still', shard.rank)\nshard.rank + 40", timeout=30)
        assert [result.ranks[r].stdout for r in (0, 1)] == ["still 0\n", "still 1\n"]
        assert result.ranks[0].result == {"text/plain": "40"}
    assert pool.push(y=list(range(3))) > 0
    assert pool.pull("y", rank=0) == [0, 1, 2]
    assert "the direct link to the kernel closed" in _rank_log(pool, 0)
    assert not links.serves(0) and links.serves(1)


def test_a_pool_whose_links_cannot_listen_runs_over_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_shard.pool.links import Links

    def refuse(self: Links, path: Path) -> str:
        raise OSError(36, "File name too long")

    monkeypatch.setattr(Links, "listen", refuse)
    with Pool(nproc=2, device="cpu", log_dir=tmp_path) as p:
        assert p.run("6 * 7", timeout=60).value == {"text/plain": "42"}
        assert not p.connection.links.serves(0) and not p.connection.links.serves(1)
        assert p.directory is not None and not (p.directory / "direct.sock").exists()


COUNTED = "runs = globals().get('runs', 0) + 1\nshard.rank + 1"
SLOW = "import time\nfor _ in range(3000):\n    time.sleep(0.01)"


def test_a_cell_sent_ahead_is_gathered_once_by_the_run_with_its_arguments(pool: Pool) -> None:
    pool.run("runs = 0")
    assert pool.send_ahead(COUNTED, None, None, 0)
    assert not pool.send_ahead(COUNTED, None, None, 0), "one cell in flight at a time"
    result = pool.run(COUNTED)
    assert result.ok and result.ranks[1].result == {"text/plain": "2"}
    assert pool.pull("runs", rank=0) == 1 and pool.pull("runs", rank=1) == 1, "sent once, run once"
    assert pool.send_ahead("ahead_only = shard.rank", (1,), 5.0, 0)
    assert pool.run("ahead_only = shard.rank", (1,), timeout=5.0).ok
    with pytest.raises(DistributedError):
        pool.run("ahead_only")  # rank 0 never ran it
    assert pool.pull("ahead_only", rank=1) == 1
    assert pool.run("pass").ok  # says the ranks are out of step, once


def test_a_cell_sent_ahead_that_no_run_takes_is_interrupted_and_the_pool_goes_on(pool: Pool) -> None:
    assert pool.send_ahead(SLOW, None, None, 0)
    time.sleep(0.3)
    started = time.monotonic()
    pool.settle_ahead()
    assert time.monotonic() - started < 5.0
    assert {s.state for s in pool.status()} == {"interrupted"}
    pool.settle_ahead()  # nothing in flight: nothing to do
    assert pool.run("shard.rank").ranks[1].result == {"text/plain": "1"}


def test_a_run_with_other_arguments_ends_the_cell_sent_ahead_first(pool: Pool) -> None:
    assert pool.send_ahead(SLOW, None, None, 0)
    started = time.monotonic()
    result = pool.run("'next'")
    assert result.ok and result.value == {"text/plain": "'next'"}
    assert time.monotonic() - started < 5.0, "the cell sent ahead was interrupted, not waited for"


def test_nothing_is_sent_ahead_where_the_run_would_first_say_something(pool: Pool) -> None:
    with pytest.raises(DistributedError):
        pool.run("if shard.rank == 1:\n    raise ValueError('one rank')")
    assert not pool.send_ahead("pass", None, None, 0), "the run first says the ranks are out of step"
    assert pool.run("pass").ok
    run = pool.run_background("import time\ntime.sleep(0.5)")
    assert not pool.send_ahead("pass", None, None, 0), "a background run is going on"
    run.wait(30)
    assert pool.send_ahead("pass", None, None, 0)
    assert pool.run("pass").ok
