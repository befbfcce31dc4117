"""A resumed rank's check of DCP's files: the metadata first, from the bytes it keeps; the data files
on a thread, said when the ranks agree; a file whose check did not finish counts as changed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.rank import state_check
from jupyter_shard.rank.state_check import StateCheck


def _suspend(tmp_path: Path) -> dict[str, str]:
    state = tmp_path / "state"
    state.mkdir()
    (state / ".metadata").write_bytes(b"meta")
    (state / "__0_0.distcp").write_bytes(b"shard 0" * 1000)
    (state / "__1_0.distcp").write_bytes(b"shard 1" * 1000)
    return {f"state/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in state.iterdir()}


def test_unchanged_files_pass_and_the_metadata_is_kept_as_checked(tmp_path: Path) -> None:
    digests = _suspend(tmp_path)
    check = StateCheck(0, 1, tmp_path, "state", digests)
    check.agree()
    assert check.metadata == b"meta" and check.names == ["state/__0_0.distcp", "state/__1_0.distcp"]


def test_a_changed_shard_is_said_when_the_ranks_agree(tmp_path: Path) -> None:
    digests = _suspend(tmp_path)
    (tmp_path / "state" / "__1_0.distcp").write_bytes(b"other")
    check = StateCheck(0, 1, tmp_path, "state", digests)  # hashed on the thread ...
    with pytest.raises(RuntimeError, match=r"^state/__1_0.distcp of this suspend does not match"):
        check.agree()  # ... said here


def test_changed_metadata_stops_at_once(tmp_path: Path) -> None:
    digests = _suspend(tmp_path)
    (tmp_path / "state" / ".metadata").write_bytes(b"meta!")
    with pytest.raises(RuntimeError, match=r"^state/.metadata of this suspend does not match"):
        StateCheck(0, 1, tmp_path, "state", digests)


def test_each_rank_hashes_its_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digests = _suspend(tmp_path)
    hashed: list[str] = []
    real = state_check._digest

    def counting(path: Path, stop: Any) -> str | None:
        hashed.append(path.name)
        return real(path, stop)

    monkeypatch.setattr(state_check, "_digest", counting)
    StateCheck(1, 2, tmp_path, "state", digests).agree()  # (no process group: this rank's view)
    assert hashed == ["__1_0.distcp"]


def test_a_check_that_did_not_finish_counts_as_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digests = _suspend(tmp_path)

    def fails(path: Path, stop: object) -> str:
        raise MemoryError  # anything, not only an OSError

    monkeypatch.setattr(state_check, "_digest", fails)
    with pytest.raises(RuntimeError, match=r"^state/__0_0.distcp of this suspend"):
        StateCheck(0, 1, tmp_path, "state", digests).agree()
    monkeypatch.undo()
    check = StateCheck(0, 1, tmp_path, "state", digests)
    check.stop()  # a resume that failed meanwhile: what was not hashed stays changed
    check.thread.join()
    assert state_check._digest(tmp_path / "state" / "__0_0.distcp", check._stop) is None
