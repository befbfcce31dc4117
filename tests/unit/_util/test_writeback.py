"""A file being written has its writeback started every stride, for the range written since the last."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jupyter_shard._util import writeback
from jupyter_shard._util.writeback import Writeback


def test_each_stride_starts_the_writeback_of_what_was_written_since(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []

    def call(*args: int) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(writeback, "_CALL", call)
    wb = Writeback(7, stride=100)
    for count in (60, 30, 20, 150, 5):
        wb.wrote(count)
    assert calls == [(7, 0, 110, 2), (7, 110, 150, 2)]
    wb.start()  # the rest, as a file is closed
    assert calls[-1] == (7, 260, 5, 2) and wb.started == wb.written == 265
    wb.start()
    assert len(calls) == 3  # nothing new written: nothing asked


def test_without_the_call_it_only_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "_CALL", None)
    wb = Writeback(7, stride=10)
    wb.wrote(25)
    assert wb.started == wb.written == 25


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_real_call_is_found_and_accepted(tmp_path: Path) -> None:
    assert writeback._CALL is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        assert writeback._CALL(fd, 0, 4096, 2) == 0
    finally:
        os.close(fd)
