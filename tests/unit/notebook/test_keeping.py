"""jupyter_shard.notebook.keeping without rank processes: the lines of %dist_suspend, %dist_resume,
%dist_pools and %dist_attach, and their one-line refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_shard.env import RUNTIME_DIR_VAR
from jupyter_shard.errors import PoolError
from jupyter_shard.notebook import keeping
from jupyter_shard.notebook.args import distributed_parser, resume_options

Capture = pytest.CaptureFixture[str]


@pytest.fixture(scope="module")
def shell(ipython: InteractiveShell) -> Iterator[InteractiveShell]:
    ipython.run_line_magic("load_ext", "jupyter_shard")
    yield ipython
    ipython.run_line_magic("unload_ext", "jupyter_shard")


def test_resume_line_gives_the_directory_the_changed_options_and_keep() -> None:
    parser = distributed_parser()
    assert resume_options(parser, "") == (None, {}, None)
    assert resume_options(parser, "runs/exp1 --nproc 4 --keep 30m") == ("runs/exp1", {"nproc": 4}, "30m")
    assert resume_options(parser, "--strategy fsdp --collective-timeout 90") == (
        None,
        {"strategy": "fsdp", "timeout": 90.0},
        None,
    )
    with pytest.raises(
        UsageError, match=r"takes the pool's options \(--nproc, --strategy, …\), not --bg, --ranks"
    ):
        resume_options(parser, "d --ranks 0 --bg")


def test_suspend_without_a_pool_and_a_bad_keep_are_one_line(shell: InteractiveShell) -> None:
    with pytest.raises(UsageError, match="no pool is running; there is nothing to suspend"):
        shell.run_line_magic("dist_suspend", "somewhere")
    with pytest.raises(UsageError, match="--keep soon: give a duration"):
        shell.run_line_magic("dist_resume", "somewhere --keep soon")


def test_pools_lists_this_users_kept_pools(
    shell: InteractiveShell,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(tmp_path))
    shell.run_line_magic("dist_pools", "")
    assert capsys.readouterr().out.startswith("no kept pools (start one with %%distributed --keep 30m)")


def test_attach_passes_the_id_and_take_over_and_refuses_other_words(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[Any, ...]] = []

    def attach(pool_id: str | None, take_over: bool, pool: Any, say: Any) -> Any:
        asked.append((pool_id, take_over))
        raise PoolError("no kept pool here")

    monkeypatch.setattr(keeping, "attach", attach)
    for line, expected in [
        ("", (None, False)),
        ("abcd --take-over", ("abcd", True)),
        ("--take-over", (None, True)),
    ]:
        with pytest.raises(PoolError):
            shell.run_line_magic("dist_attach", line)
        assert asked.pop() == expected
    with pytest.raises(UsageError, match=r"%dist_attach \[ID\] \[--take-over\]"):
        shell.run_line_magic("dist_attach", "a b")
    with pytest.raises(UsageError, match=r"%dist_attach \[ID\] \[--take-over\]"):
        shell.run_line_magic("dist_attach", "--force")
