"""The kernel makes room for many ranks' connections: the soft limit on open files is raised to what
the pool needs, up to the hard limit, and a pool the hard limit cannot hold is refused in one line."""

from __future__ import annotations

import resource

import pytest

from jupyter_shard._util import open_files


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    state = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: state["now"])

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        if value[0] > value[1]:
            raise ValueError("soft above hard")
        state["now"] = value

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    return state


def test_a_small_pool_leaves_the_limit_alone(limits: dict[str, tuple[int, int]]) -> None:
    assert open_files.make_room(64) == "" and limits["now"] == (1024, 4096)


def test_1024_ranks_raise_the_soft_limit_within_the_hard_one(limits: dict[str, tuple[int, int]]) -> None:
    limits["now"] = (1024, 65536)
    assert open_files.make_room(1024) == ""
    assert limits["now"] == (1024 * open_files.PER_RANK + open_files.SPARE, 65536)


def test_a_pool_the_hard_limit_cannot_hold_is_refused_in_one_line(limits: dict[str, tuple[int, int]]) -> None:
    said = open_files.make_room(1024)
    assert limits["now"] == (4096, 4096)  # raised as far as it goes
    assert "1024 ranks need about 4352 open files" in said and "hard limit 4096" in said
    assert "\n" not in said
