"""Helpers shared by the export unit tests: transcripts of cells and pushes, a rendering, a script run
in-process with a stand-in ``shard``.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from jupyter_shard.export.render import render_script
from jupyter_shard.pool.transcript import CellEntry, PushEntry, Transcript
from jupyter_shard.rank import script as script_module
from jupyter_shard.spec import LaunchSpec

WHEN = datetime(2025, 1, 2, 3, 4)


def _cell(code: str, n: int, ranks: tuple[int, ...] | None = None, status: str = "ok") -> CellEntry:
    return CellEntry(f"# %%distributed\n{code}", ranks, status, n)


def _push(ranks: tuple[int, ...] | None = None, **values: Any) -> PushEntry:
    return PushEntry(tuple((k, cloudpickle.dumps(v)) for k, v in values.items()), ranks)


def _transcript(*entries: CellEntry | PushEntry) -> Transcript:
    t = Transcript()
    for e in entries:
        t.add(e)
    return t


def _render(*entries: CellEntry | PushEntry, spec: LaunchSpec | None = None) -> str:
    rendered = render_script(_transcript(*entries), spec or LaunchSpec(), "train.py", source="nb", when=WHEN)
    compile(rendered.text, "train.py", "exec")  # every rendering is a valid script
    return rendered.text


class _FakeShard:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def _run_script(text: str, rank: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Execute a rendered script in-process with ``start`` giving a stand-in ``shard`` of ``rank``."""
    started: list[dict[str, Any]] = []

    def start(**kwargs: Any) -> _FakeShard:
        started.append(kwargs)
        return _FakeShard(rank)

    monkeypatch.setattr(script_module, "start", start)
    monkeypatch.setattr(script_module, "finish", lambda: None)
    path = tmp_path / "train.py"
    namespace: dict[str, Any] = {"__name__": "exported", "__file__": str(path)}
    exec(compile(text, str(path), "exec"), namespace)
    namespace["_started"] = started
    return namespace
