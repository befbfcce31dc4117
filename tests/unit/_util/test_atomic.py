"""jupyter_shard._util.atomic: a file is replaced whole or left as it was."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TextIO

import pytest

from jupyter_shard._util import atomic
from jupyter_shard._util.atomic import write_atomic


def _leftovers(directory: Path, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != name)


def test_text_is_written_exactly_and_the_path_returned(tmp_path: Path) -> None:
    target = tmp_path / "metrics.csv"
    returned = write_atomic(str(target), "step,loss\r\n1,0.5\n")
    assert returned == target and isinstance(returned, Path)
    assert target.read_bytes() == b"step,loss\r\n1,0.5\n"  # newline="": no translation
    assert _leftovers(tmp_path, "metrics.csv") == []


def test_a_writer_function_gets_the_open_file(tmp_path: Path) -> None:
    def write(fh: TextIO) -> None:
        fh.write("a\n")
        fh.write("b\n")

    target = write_atomic(tmp_path / "out.txt", write)
    assert target.read_text() == "a\nb\n"


def test_an_existing_file_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "ds_config.json"
    target.write_text("old and much longer content")
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert _leftovers(tmp_path, "ds_config.json") == []


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, error: BaseException) -> None:
    target = tmp_path / "metrics.csv"
    target.write_text("complete old file\n")

    def half_then_fail(fh: TextIO) -> None:
        fh.write("half a new ")
        raise error

    with pytest.raises(type(error)):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "complete old file\n"
    assert _leftovers(tmp_path, "metrics.csv") == []


def test_a_failed_write_to_a_new_path_creates_nothing(tmp_path: Path) -> None:
    def fail(fh: TextIO) -> None:
        raise ValueError("bad row")

    with pytest.raises(ValueError, match="bad row"):
        write_atomic(tmp_path / "new.csv", fail)
    assert list(tmp_path.iterdir()) == []


def test_the_content_is_synced_in_a_hidden_temporary_beside_the_target_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.txt"
    events: list[tuple[str, object]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", fd))
        real_fsync(fd)

    def replace(src: str, dst: str | os.PathLike[str]) -> None:
        events.append(("replace", (Path(src), Path(dst), Path(src).read_text())))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    write_atomic(target, "whole")
    assert [kind for kind, _ in events] == ["fsync", "replace"]
    src, dst, content = events[1][1]  # type: ignore[misc]
    assert src.parent == tmp_path and src.name.startswith(".out.txt.") and src.name.endswith(".tmp")
    assert dst == target and content == "whole"


def test_a_failed_rename_removes_the_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def replace(src: str, dst: str) -> None:
        raise PermissionError("read-only target")

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "out.txt", "x")
    assert list(tmp_path.iterdir()) == []


def test_a_new_file_gets_the_mode_a_plain_open_would_give(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        target = write_atomic(tmp_path / "metrics.csv", "step,loss\n")
        (tmp_path / "plain.csv").write_text("step,loss\n")
    finally:
        os.umask(previous)
    assert (
        stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE((tmp_path / "plain.csv").stat().st_mode) == 0o644
    )


def test_a_replaced_file_keeps_its_own_mode(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    target.write_text("{}")
    target.chmod(0o600)
    write_atomic(target, '{"a": 1}')
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == '{"a": 1}'


def test_private_files_are_0600_whole_and_leave_no_temporary(tmp_path: Path) -> None:
    from jupyter_shard._util.atomic import write_private

    target = tmp_path / "kept.json"
    target.write_text("old")
    target.chmod(0o644)
    write_private(target, '{"key": "00"}')
    assert target.read_text() == '{"key": "00"}' and oct(target.stat().st_mode & 0o777) == "0o600"
    write_private(tmp_path / "part.pkl", b"\x00\x01")
    assert (tmp_path / "part.pkl").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "part.pkl"]
