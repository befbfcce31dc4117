"""The kept record's lock: one holder across processes and threads, re-entrant in one thread, lost
with a process that dies holding it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jupyter_shard._util.record_lock import LOCK_FILE, RecordBusy, record_lock

HOLD = """
import sys, time
from pathlib import Path
from jupyter_shard._util.record_lock import record_lock
with record_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_another_process_waits_and_gives_up_after_the_wait(tmp_path: Path) -> None:
    proc = _holder(tmp_path, 30)
    try:
        began = time.monotonic()
        with pytest.raises(RecordBusy), record_lock(tmp_path, wait=0.3):
            pass
        assert 0.3 <= time.monotonic() - began < 2
    finally:
        proc.kill()
        proc.wait()
    with record_lock(tmp_path, wait=1.0):  # a holder that died lost it
        pass
    assert oct((tmp_path / LOCK_FILE).stat().st_mode & 0o777) == "0o600"


def test_one_thread_may_take_it_again_and_another_thread_waits(tmp_path: Path) -> None:
    order: list[str] = []
    with record_lock(tmp_path):
        with record_lock(tmp_path, wait=0.1):  # re-entrant: no wait
            order.append("inner")

        def other() -> None:
            with record_lock(tmp_path, wait=5):
                order.append("other")

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        order.append("outer")
    thread.join(5)
    assert order == ["inner", "outer", "other"]


def test_a_link_in_place_of_the_lock_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("x")
    os.symlink(target, tmp_path / LOCK_FILE)
    with pytest.raises(OSError), record_lock(tmp_path):
        pass
