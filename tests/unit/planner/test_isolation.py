"""jupyter_shard.planner.isolation: a function run beside a real default process group sees none,
hands back its result or its one-line error, and leaves the caller's group as it was."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from jupyter_shard.errors import SpecError
from jupyter_shard.planner.isolation import forked


@pytest.fixture
def real_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_child_sees_no_group_and_the_caller_keeps_its_own(real_group: None) -> None:
    world = dist.group.WORLD
    seen = forked(lambda: (dist.is_initialized(), os.getpid()))
    assert seen[0] is False and seen[1] != os.getpid()
    assert dist.group.WORLD is world and dist.get_world_size() == 1


def test_errors_come_back_as_one_line() -> None:
    def fails() -> None:
        raise SpecError("pass a model")

    with pytest.raises(SpecError, match=r"^pass a model$"):
        forked(fails)
    with pytest.raises(SpecError, match="failed in its child process: ZeroDivisionError"):
        forked(lambda: 1 / 0)


def test_a_child_that_dies_is_one_line() -> None:
    with pytest.raises(SpecError, match="child process died"):
        forked(lambda: os._exit(3))
