"""Fixtures for the fast unit tests: no rank processes, no GPUs; process groups only in-process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def mesh() -> Iterator[Any]:
    """A 2-rank device mesh, this process rank 1, over torch's fake process group: shapes and
    placements of DTensors, no peers and no collectives."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo default group in this process (a FileStore in ``tmp_path``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
