"""F10: a rank that prints 10 MB to stdout and 10 MB to stderr never stalls, floods nor loses output.

Ranks write straight to their log file (no pipe that fills at 64 KiB) and send the kernel coalesced
chunks; the kernel shows at most ``MAX_LINES_SHOWN`` lines / ``MAX_BYTES_SHOWN`` bytes per rank and
cell: the first lines, a notice naming the rank's log file (which keeps every byte), and when the cell
ends how many lines were not shown and the last ``TAIL_LINES``.

The pool has no option for start-up code, so start-up output is injected the way any code runs
before a rank's own: a ``sitecustomize`` module on the ``PYTHONPATH`` the pool hands its ranks
(gated on the variables only a rank has, so the kernel imports it as a no-op).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.session import Session

from jupyter_shard.pool.output import MAX_BYTES_SHOWN, MAX_LINES_SHOWN, TAIL_LINES

pytestmark = pytest.mark.timeout(300)

LINE_BYTES = 100  # every flood line is 99 characters and a newline
LINES = 10 * 2**20 // LINE_BYTES  # 10 MiB per stream
MAX_STREAM_MESSAGES = 2000
JUPYTER_SERVER_WINDOW_BYTES = 3 * 10**6  # jupyter_server drops output above 1 MB/s over a 3 s window
PROBE_LIMIT = 2.0


def _flood_code(prefix: str, stream: str) -> str:
    """Code that prints ``LINES`` numbered lines of ``LINE_BYTES`` bytes to ``sys.<stream>``."""
    return (
        f"for _i in range({LINES}):\n"
        f"    print(f'{prefix} {{_i:07d}} ' + 'x' * {LINE_BYTES - len(prefix) - 10}, file=sys.{stream})\n"
    )


def _expected(prefix: str) -> list[str]:
    return [f"{prefix} {i:07d} " + "x" * (LINE_BYTES - len(prefix) - 10) for i in range(LINES)]


def _assert_full_log(log: Path, prefixes: tuple[str, ...]) -> int:
    """Every flood line is in ``log``, in order, byte for byte; returns the log's size."""
    data = log.read_bytes()
    lines = data.decode().splitlines()
    for prefix in prefixes:
        got = [line for line in lines if line.startswith(prefix + " ")]
        assert len(got) == LINES, f"{log}: {len(got)} of {LINES} '{prefix}' lines"
        assert got[0] == _expected(prefix)[0] and got[-1] == _expected(prefix)[-1]
        assert got == _expected(prefix), f"{log}: '{prefix}' lines differ from what was printed"
        assert sum(len(line) + 1 for line in got) == LINES * LINE_BYTES
    assert len(data) >= len(prefixes) * LINES * LINE_BYTES
    return len(data)


def _log_path(kernel: Any, rank: int) -> Path:
    """The rank's log file as ``%dist_status`` shows it."""
    table = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    found = re.search(r"^logs: (\S+rank-)<k>(\.log)$", table, re.MULTILINE)  # the footer under the rows
    assert found, table
    return Path(f"{found.group(1)}{rank}{found.group(2)}")


def _stream_messages(kernel: Any, since: float) -> list[dict[str, Any]]:
    return [m for t, m in kernel.messages if t >= since and m["msg_type"] == "stream"]


class ControlProbe:
    """Sends ``kernel_info_request`` on the control channel every 0.1 s from its own thread.

    The shell channel is busy for the whole of a foreground cell by design; the control channel is
    served by ipykernel's own thread and must still answer while the kernel receives a flood.
    """

    def __init__(self, kernel: Any) -> None:
        # its own Session: one shared with the test's client numbers messages racily across threads
        session = Session(key=kernel.km.session.key, signature_scheme=kernel.km.session.signature_scheme)
        self.client = kernel.km.client(session=session)
        self.client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        self.latencies: list[tuple[float, float]] = []  # (sent at, seconds to the reply)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ControlProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.stop_channels()

    def _run(self) -> None:
        channel = self.client.control_channel
        while not self._stop.is_set():
            request = self.client.session.msg("kernel_info_request")
            sent = time.monotonic()
            channel.send(request)
            while channel.get_msg(timeout=60)["parent_header"].get("msg_id") != request["header"]["msg_id"]:
                pass
            self.latencies.append((sent, time.monotonic() - sent))
            self._stop.wait(0.1)


def test_flood_at_startup_goes_to_the_log_without_stalling_the_pool(
    kernel_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('JUPYTER_SHARD_ADDRESS') and os.environ.get('RANK') == '1':\n"
        + "\n".join(
            f"    {line}"
            for line in (_flood_code("boot-out", "stdout") + _flood_code("boot-err", "stderr")).splitlines()
        )
        + "\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    # Interpreter start-up code (sitecustomize) runs in each rank only when ranks are spawned: a rank
    # forked from the zygote starts from the zygote's interpreter, which ran it without rank variables.
    monkeypatch.setenv("JUPYTER_SHARD_ZYGOTE", "0")
    kernel = kernel_factory()
    assert kernel.execute("%load_ext jupyter_shard").ok
    since = time.monotonic()
    first = kernel.execute("%%distributed --nproc 2 --device cpu\nshard.world_size", timeout=240)
    assert first.ok, first.outputs
    assert first.data("execute_result") == [{"text/plain": "2"}]
    assert first.elapsed < 120, f"start-up with a 20 MB flood took {first.elapsed:.1f} s"
    shown = _stream_messages(kernel, since)
    assert len(shown) < MAX_STREAM_MESSAGES
    assert sum(len(m["content"]["text"]) for m in shown) < MAX_BYTES_SHOWN, "start-up flood reached the UI"

    after = kernel.execute(
        "%%distributed\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(1); dist.all_reduce(t); t.item()"
    )
    assert after.data("execute_result") == [{"text/plain": "2.0"}]
    assert after.elapsed < 30
    size = _assert_full_log(_log_path(kernel, 1), ("boot-out", "boot-err"))
    print(f"start-up flood: first cell {first.elapsed:.2f} s, {len(shown)} stream messages, log {size} bytes")


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_flood_in_a_cell_is_coalesced_capped_and_fully_logged(kernel: Any, nproc: int) -> None:
    assert kernel.execute("%load_ext jupyter_shard").ok
    assert kernel.execute(f"%%distributed --nproc {nproc} --device cpu\nimport sys, torch").ok
    log = _log_path(kernel, 1)
    code = (
        "%%distributed\nimport torch.distributed as dist\n"
        "if shard.rank == 1:\n"
        + "\n".join(
            f"    {line}"
            for line in (_flood_code("out", "stdout") + _flood_code("err", "stderr")).splitlines()
        )
        + "\nelse:\n    print('rank 0 is still heard')\n"
        "t = torch.ones(1); dist.all_reduce(t); t.item()\n"
    )
    since = time.monotonic()
    with ControlProbe(kernel) as probe:
        run = kernel.execute(code, timeout=240)
        ended = time.monotonic()
    assert run.ok, run.outputs
    assert run.data("execute_result") == [{"text/plain": f"{float(nproc)}"}]
    assert run.elapsed < 60, f"the flood cell took {run.elapsed:.1f} s"

    during = [seconds for sent, seconds in probe.latencies if sent < ended]
    assert during, "no control request was answered while the flood cell ran"
    assert max(during) < PROBE_LIMIT, f"control channel answered in {max(during):.2f} s during the flood"

    messages = _stream_messages(kernel, since)
    shown = sum(len(m["content"]["text"].encode()) for m in messages)
    assert len(messages) < MAX_STREAM_MESSAGES, f"{len(messages)} stream messages for 20 MB"
    assert shown < JUPYTER_SERVER_WINDOW_BYTES, f"{shown} bytes sent to the notebook"
    stdout = run.stream("stdout")
    assert "[rank 1] " + _expected("out")[0] + "\n" in stdout
    assert "[rank 0] rank 0 is still heard\n" in stdout
    # the first lines, a count of those not shown, then the rank's last lines (its stderr flood's)
    running = (
        "[rank 1] … more output not shown while the cell runs; its last lines follow when it ends "
        f"(full log: {log})\n"
    )
    assert (stdout + run.stream("stderr")).count(running) == 1
    shown = (MAX_LINES_SHOWN - TAIL_LINES) + TAIL_LINES
    assert f"[rank 1] … {2 * LINES - shown:,} lines not shown (full log: {log})\n" in stdout
    assert run.stream("stderr").endswith(
        "".join(f"[rank 1] {line}\n" for line in _expected("err")[-TAIL_LINES:])
    ), run.stream("stderr")[-300:]

    again = kernel.execute("%%distributed\nshard.world_size")
    back = time.monotonic() - ended
    assert again.data("execute_result") == [{"text/plain": f"{nproc}"}]
    assert back < 5.0, f"back to a working cell {back:.1f} s after the flood cell ended"
    size = _assert_full_log(log, ("out", "err"))
    print(
        f"cell flood: {run.elapsed:.2f} s, {len(messages)} stream messages ({shown} bytes shown), "
        f"{len(during)} control probes (max {max(during) * 1000:.0f} ms), log {size} bytes"
    )
