"""Where a suspend may go: never over the user's files or the kernel's working directory, never
under another kernel's suspend; a half-written suspend left by a killed kernel is cleaned and said."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from jupyter_shard import PoolError
from jupyter_shard.pool.suspend_target import claim, is_suspend, sync_tree


def a_suspend(path: Path, ranks: int = 2) -> Path:
    """What a suspend leaves: the manifest, the spec, the recipe, each rank's namespace, DCP's files."""
    (path / "state").mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": 1, "world_size": ranks}))
    for name in ("spec.pkl", "model.pkl", *(f"namespace-{r}.pkl" for r in range(ranks))):
        (path / name).write_bytes(b"x")
    (path / "state" / ".metadata").write_bytes(b"m")
    return path


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')")
    (project / "data" / "x.csv").write_text("1,2")
    (project / "notes.md").write_text("#")
    (project / "manifest.json").write_text("{}")  # a name of ours among the user's is not a suspend
    before = tree(project)
    with pytest.raises(PoolError) as refused:
        claim(project)
    message = str(refused.value)
    assert "\n" not in message and "already holds files that are not a suspend" in message
    assert "(data/, manifest.json, notes.md and 1 more)" in message and "suspend to a new or empty" in message
    assert tree(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no temporary left either


def test_an_earlier_suspend_with_a_file_of_the_users_added_is_refused(tmp_path: Path) -> None:
    run = a_suspend(tmp_path / "run")
    assert is_suspend(run)
    (run / "my-notes.txt").write_text("keep me")
    assert not is_suspend(run)
    with pytest.raises(PoolError, match=r"not a suspend .*my-notes\.txt"):
        claim(run)
    assert (run / "my-notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("where", [".", ".."])
def test_the_kernels_working_directory_is_never_a_target(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside = a_suspend(tmp_path / "run")  # even one that is a suspend: the kernel stands in it
    monkeypatch.chdir(inside)
    with pytest.raises(PoolError, match="holds this kernel's working directory; suspend to a new directory"):
        claim(Path(where).absolute())
    assert is_suspend(inside)


def test_a_file_or_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(PoolError, match="is a file, not a directory"):
        claim(tmp_path / "file")
    (tmp_path / "link").symlink_to(a_suspend(tmp_path / "elsewhere"))
    with pytest.raises(PoolError, match="is a symbolic link"):
        claim(tmp_path / "link")


def test_new_empty_and_earlier_suspends_are_claimed_locked(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "new", tmp_path / "empty", a_suspend(tmp_path / "old")):
        held = claim(target)
        assert held.tmp == target.with_name(f".{target.name}.suspending") and held.tmp.is_dir()
        assert held.notes == []
        held.release()


def _hold(target: str, ready: object, done: object) -> None:
    held = claim(Path(target))
    ready.set()  # type: ignore[attr-defined]
    done.wait(30)  # type: ignore[attr-defined]
    held.release()


def test_a_second_kernel_suspending_to_the_same_directory_is_refused_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    target = tmp_path / "run"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    first = context.Process(target=_hold, args=(str(target), ready, done))
    first.start()
    try:
        assert ready.wait(60)
        work = target.with_name(".run.suspending") / "namespace-0.pkl"
        work.write_bytes(b"the first kernel's work")
        with pytest.raises(PoolError, match=r"another kernel is suspending to .*/run right now; wait for it"):
            claim(target)
        assert work.read_bytes() == b"the first kernel's work"
    finally:
        done.set()
        first.join(30)


def test_a_half_written_suspend_of_a_killed_kernel_is_emptied_reused_and_said(tmp_path: Path) -> None:
    left = tmp_path / ".run.suspending"
    left.mkdir(mode=0o700)  # as the killed kernel made it
    (left / "state").mkdir()
    (left / "state" / "__0_0.distcp").write_bytes(b"\0" * (3 << 20))
    held = claim(tmp_path / "run")
    try:
        assert held.tmp == left and list(left.iterdir()) == []
        assert held.notes == [
            "jupyter_shard: removed a half-written suspend (3.0 MiB in .run.suspending) left by a kernel "
            "that stopped while suspending"
        ]
    finally:
        held.release()


def test_an_interrupted_swap_puts_the_last_suspend_back_first(tmp_path: Path) -> None:
    old = a_suspend(tmp_path / ".run.old")
    held = claim(tmp_path / "run")
    held.release()
    assert not old.exists() and is_suspend(tmp_path / "run")
    put_back = f"jupyter_shard: put back {tmp_path / 'run'}, the last suspend, from an interrupted swap"
    assert held.notes == [put_back]


def test_sync_tree_syncs_every_file_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = a_suspend(tmp_path / "run")
    synced: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    sync_tree(run)
    assert len(synced) == 6 + 2  # five files and .metadata, then state/ and run/


def test_files_added_while_the_ranks_wrote_stop_the_swap(tmp_path: Path) -> None:
    from jupyter_shard.pool.suspend_target import check_again

    (tmp_path / "run").mkdir()
    held = claim(tmp_path / "run")  # empty: claimed
    try:
        (tmp_path / "run" / "results.csv").write_text("saved meanwhile")
        with pytest.raises(PoolError, match=r"now holds files that are not a suspend \(results.csv\)"):
            check_again(tmp_path / "run")
    finally:
        held.release()
    assert (tmp_path / "run" / "results.csv").read_text() == "saved meanwhile"


def test_a_temporary_others_can_write_is_never_taken_over(tmp_path: Path) -> None:
    planted = tmp_path / ".run.suspending"
    planted.mkdir()
    planted.chmod(0o777)  # made by someone else in a shared directory, for our ranks to write into
    with pytest.raises(PoolError, match="is in the way of the suspend and is not this user's alone"):
        claim(tmp_path / "run")


def test_sync_tree_makes_the_tree_private_whatever_the_umask(tmp_path: Path) -> None:
    run = a_suspend(tmp_path / "run")
    for path in [run, *run.rglob("*")]:
        path.chmod(0o775 if path.is_dir() else 0o664)  # what umask 002 gives DCP's files
    sync_tree(run)
    assert {oct(p.stat().st_mode & 0o777) for p in [run, *run.rglob("*")] if p.is_dir()} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in run.rglob("*") if p.is_file()} == {"0o600"}
