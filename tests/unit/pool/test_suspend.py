"""The kernel's half of suspend and resume without ranks: the swap that makes a suspend atomic, which
directory a resume reads, the one-line errors and the reports' wording."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_shard.errors import PoolError
from jupyter_shard.pool import suspend as module
from jupyter_shard.pool.suspend import Resumed, Suspended, resume
from jupyter_shard.pool.suspend_seal import seal


def _dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "manifest.json").write_text(text)
    return path


def test_swap_replaces_the_old_suspend_and_leaves_no_sibling(tmp_path: Path) -> None:
    final = _dir(tmp_path / "run", '{"format": 2, "v": "old"}')
    tmp = _dir(tmp_path / ".run.suspending", '{"format": 2, "v": "new"}')
    module._swap(tmp, final)
    assert (final / "manifest.json").read_text() == '{"format": 2, "v": "new"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_swap_cut_between_its_renames_is_still_read(tmp_path: Path) -> None:
    _dir(tmp_path / ".run.old", "good")
    assert module._readable(tmp_path / "run") == tmp_path / ".run.old"
    with pytest.raises(PoolError, match="no suspend in"):
        module._readable(tmp_path / "elsewhere")


def test_resume_of_another_format_is_one_line(tmp_path: Path) -> None:
    root = _dir(tmp_path / "run", '{"format": 99}')
    (root / "manifest.sig").write_bytes(seal(root, (root / "manifest.json").read_bytes()))
    with pytest.raises(PoolError, match=r"another version of jupyter_shard \(format 99\)"):
        resume(root)


def test_reports_say_what_was_kept_lost_and_resharded(tmp_path: Path) -> None:
    s = Suspended(tmp_path, 2, "fsdp", 1.25, 3 * 2**20, ["model", "opt"], {"gen": "TypeError: no"}, True)
    text = s.summary()
    assert "suspended 2 ranks (fsdp)" in text and "3.0 MiB" in text and "model, opt" in text
    assert text.splitlines()[1] == "jupyter_shard: not kept: gen (TypeError: no)"
    r = Resumed(tmp_path, 4, 2, 2.0, ["model"], {}, True)
    assert "on 4 ranks" in r.summary() and "resharded" in r.summary()
    assert "resharded" not in Resumed(tmp_path, 2, 2, 2.0, ["model"]).summary()
