"""The live line of a suspend or a resume: bytes per rank from the files being written or from what
each rank has read, the rate, shown only for long work, redrawn in place and cleared at the end."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from jupyter_shard.pool import disk_progress
from jupyter_shard.pool.disk_progress import DiskProgress, bytes_read, bytes_written, line


def test_bytes_written_counts_each_ranks_files_only(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "namespace-0.pkl").write_bytes(b"x" * 100)
    (tmp_path / "namespace-12.pkl").write_bytes(b"x" * 7)
    (tmp_path / "state" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / "state" / "__12_3.distcp").write_bytes(b"x" * 10)
    (tmp_path / "state" / ".metadata").write_bytes(b"x" * 50)
    (tmp_path / "model.pkl").write_bytes(b"x" * 50)
    assert bytes_written(tmp_path) == {0: 1100, 12: 17}
    assert bytes_written(tmp_path / "absent") == {}


def test_bytes_read_counts_what_a_process_read_since_it_began(tmp_path: Path) -> None:
    data = tmp_path / "blob"
    data.write_bytes(os.urandom(3 << 20))
    sample = bytes_read({5: os.getpid()})
    data.read_bytes()
    assert sample()[5] >= 3 << 20
    assert bytes_read({1: 2**22 + 12345})() == {}  # no such process: nothing counted


def test_the_line_says_amount_rate_and_spread() -> None:
    text = line("suspending", "written", [600 << 20, 590 << 20], 2.0, None)
    assert text == "suspending: 1.16 GiB written, 595 MiB/s, 2 s; per rank 590–600 MiB; Ctrl-C stops it"
    text = line("resuming", "read", [1 << 30], 4.0, 4 << 30)
    assert text == "resuming: 1.00 GiB of 4.00 GiB read, 256 MiB/s, 4 s; Ctrl-C stops it"
    # a resharding resume may read past what was expected: the bytes alone, never "5 GiB of 4 GiB"
    text = line("resuming", "read", [5 << 30], 4.0, 4 << 30)
    assert text == "resuming: 5.00 GiB read, 1.25 GiB/s, 4 s; Ctrl-C stops it"


def test_a_resume_expects_dcps_files_read_twice_and_the_rest_once(tmp_path: Path) -> None:
    from jupyter_shard.pool.suspend import _expected_reads

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / "state" / ".metadata").write_bytes(b"m" * 10)
    manifest = {"ranks": {"0": {"bytes": 1000 + 50}, "1": {"bytes": 40}}}  # DCP's part and a namespace
    assert _expected_reads(tmp_path, manifest) == 1090 + 1010
    assert _expected_reads(tmp_path / "gone", manifest) == 1090


def test_long_work_shows_one_line_redrawn_in_place_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_progress, "QUIET_FOR", 0.0)
    monkeypatch.setattr(disk_progress, "EVERY", 0.05)
    out = io.StringIO()
    sizes = iter(range(1, 10**6))
    with DiskProgress("suspending", "written", lambda: {0: next(sizes) << 20}, out=out):
        time.sleep(0.4)
    text = out.getvalue()
    assert text.count("\r") >= 4 and "\n" not in text
    assert "suspending: " in text and "MiB written" in text
    assert text.endswith("\r") and text.rsplit("\r", 2)[-2].strip() == ""  # cleared


def test_quick_work_shows_nothing() -> None:
    out = io.StringIO()
    with DiskProgress("resuming", "read", lambda: {0: 1}, out=out):
        pass
    assert out.getvalue() == ""


def test_jupyter_shard_progress_0_shows_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a notebook run whose outputs are kept: nothing is written, however long the work."""
    monkeypatch.setattr(disk_progress, "QUIET_FOR", 0.0)
    monkeypatch.setattr(disk_progress, "EVERY", 0.05)
    monkeypatch.setenv("JUPYTER_SHARD_PROGRESS", "0")
    out = io.StringIO()
    with DiskProgress("resuming", "read", lambda: {0: 1 << 20}, 2 << 20, out=out):
        time.sleep(0.3)
    assert out.getvalue() == ""
    monkeypatch.setenv("JUPYTER_SHARD_PROGRESS", "1")
    with DiskProgress("resuming", "read", lambda: {0: 1 << 20}, 2 << 20, out=out):
        time.sleep(0.3)
    assert "resuming: " in out.getvalue()
