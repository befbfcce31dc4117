"""Fixtures for the fast unit tests: no rank processes, no sockets, no GPUs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_shard import spec


@pytest.fixture
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this machine look GPU-less to :func:`jupyter_shard.spec.visible_gpus`."""
    monkeypatch.setattr(spec, "visible_gpus", lambda: 0)


@pytest.fixture
def fake_dev(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``/dev`` as seen by visible_gpus: edit the yielded list to add device nodes."""
    names: list[str] = []
    real_listdir = os.listdir

    def listdir(path: str | os.PathLike[str] = ".") -> list[str]:
        if os.fspath(path) == "/dev":
            return list(names)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield names


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "unpickled.marker"
