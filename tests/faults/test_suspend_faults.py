"""F22: a suspend interrupted (a rank killed, the disk full) or a resume that cannot load. The last good
suspend stays loadable, the error is one line, and the pool is usable or cleanly gone."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jupyter_shard import Pool, PoolError
from jupyter_shard.pool.output import ConsoleSink
from jupyter_shard.pool.suspend import resume, suspend
from jupyter_shard.spec import LaunchSpec

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
model, opt = shard.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
kept = 41
"""
# The next write of a suspend file on the last rank fails as a full disk does, or kills the rank.
FAIL_NEXT_WRITE = """
import errno, os, signal
import jupyter_shard.rank.suspend as _s
def _broken(path, data):
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
_s._write = _broken
"""


def _pool(nproc: int, strategy: str = "ddp") -> Pool:
    spec = LaunchSpec.create(nproc=nproc, device="cpu", strategy=strategy)
    return Pool(spec=spec, sink=ConsoleSink(io.StringIO(), io.StringIO()))


def _first_suspend(pool: Pool, directory: Path) -> str:
    """A good suspend of ``pool`` (which is then started again with the same state), its manifest."""
    pool.run(SETUP)
    suspend(pool, directory)
    resumed, _ = resume(directory, pool=pool)
    assert resumed is pool and pool.run("kept + 1").value == {"text/plain": "42"}
    return (directory / "manifest.json").read_text()


@pytest.mark.parametrize("nproc", [2, 3])
def test_f22_disk_full_during_a_suspend_keeps_the_ranks_and_the_last_good_suspend(
    nproc: int, tmp_path: Path
) -> None:
    directory = tmp_path / "run"
    with _pool(nproc) as pool:
        manifest = _first_suspend(pool, directory)
        pool.run("kept = 99\n" + FAIL_NEXT_WRITE.format(kill=False), ranks=[nproc - 1])
        with pytest.raises(PoolError) as failed:
            suspend(pool, directory)
        message = str(failed.value)
        assert len(message.splitlines()) == 1
        assert f"rank {nproc - 1}: OSError: [Errno 28] No space left on device" in message
        assert "the ranks keep running with their state" in message
        assert "still holds the last good suspend" in message
        assert pool.started and pool.run("kept", ranks=[nproc - 1]).value == {"text/plain": "99"}
    assert (directory / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the half-written one is gone
    again, _ = resume(directory)
    with again:
        assert again.run("kept").value == {"text/plain": "41"}


@pytest.mark.parametrize("nproc", [2, 3])
def test_f22_a_rank_killed_during_a_suspend_leaves_the_last_good_suspend(nproc: int, tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with _pool(nproc) as pool:
        manifest = _first_suspend(pool, directory)
        pool.run(FAIL_NEXT_WRITE.format(kill=True), ranks=[nproc - 1])
        with pytest.raises(PoolError) as failed:
            suspend(pool, directory)
        message = str(failed.value)
        assert len(message.splitlines()) == 1
        assert f"rank {nproc - 1} died, so the pool needs %dist_restart" in message
        assert "still holds the last good suspend" in message
    assert (directory / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    again, report = resume(directory, {"nproc": 2})
    with again:
        assert report.saved_world_size == nproc
        assert again.run("kept").value == {"text/plain": "41"}


def test_f22_a_resume_that_cannot_load_stops_cleanly_and_leaves_the_suspend(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with _pool(2, "fsdp") as pool:
        pool.run(SETUP)
        suspend(pool, directory)
    before = sorted((p.relative_to(directory), p.stat().st_size) for p in directory.rglob("*"))
    with pytest.raises(PoolError) as failed:
        resume(directory, {"strategy": "deepspeed", "zero_stage": 3})
    message = str(failed.value)
    assert len(message.splitlines()) == 1
    assert "written by --strategy fsdp" in message and "resume with --strategy fsdp" in message
    assert f"the pool was stopped and {directory} is unchanged" in message
    assert sorted((p.relative_to(directory), p.stat().st_size) for p in directory.rglob("*")) == before
    pool, _ = resume(directory, {"strategy": "ddp", "nproc": 3})  # ddp reads what fsdp wrote
    with pool:
        assert pool.run("kept").value == {"text/plain": "41"}


def test_f22_resume_from_a_directory_without_a_suspend_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match=r"^no suspend in .*; suspend a pool there with %dist_suspend$"):
        resume(tmp_path / "nothing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text(json.dumps({"format": 2}))
    with pytest.raises(PoolError, match=r"has no signature \(manifest.sig is missing\).*nothing was loaded$"):
        resume(tmp_path / "broken")


def test_a_suspend_into_a_project_folder_is_refused_and_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``%dist_suspend .`` from a project folder: refused in one line before any rank writes; the
    user's files, the kernel's working directory, the ranks and their state are as they were."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    (project / "src" / "model.py").write_text("class Net: ...\n")
    monkeypatch.chdir(project)
    with _pool(2) as pool:
        pool.run(SETUP)
        for where in (".", str(project), str(tmp_path)):
            with pytest.raises(PoolError) as refused:
                suspend(pool, where)
            assert len(str(refused.value).splitlines()) == 1
            assert "working directory" in str(refused.value) or "not a suspend" in str(refused.value)
        assert Path.cwd() == project and (project / "train.py").read_text() == "print('mine')\n"
        assert (project / "src" / "model.py").is_file()
        assert sorted(p.name for p in project.iterdir()) == ["src", "train.py"]
        assert pool.started and pool.run("kept").value == {"text/plain": "41"}
        # a directory of its own in the project is fine, and a second suspend there replaces the first
        suspend(pool, "run")
        resumed, _ = resume("run", pool=pool)
        resumed.run("kept = 42")
        suspend(resumed, "run")
    assert sorted(p.name for p in project.iterdir()) == ["run", "src", "train.py"]
    again, _ = resume(project / "run")
    with again:
        assert again.run("kept").value == {"text/plain": "42"}


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_resume_that_cannot_load_leaves_the_running_pool_alone(damage: str, tmp_path: Path) -> None:
    """Checked before the running pool is let go: a rank's part missing or cut short is one line,
    and the pool that was running keeps running with its state."""
    directory = tmp_path / "run"
    with _pool(2) as pool:
        _first_suspend(pool, directory)
        part = directory / "namespace-1.pkl"
        if damage == "missing":
            part.unlink()
        else:
            part.write_bytes(part.read_bytes()[:-10])
        pool.run("kept = 7")
        said: list[str] = []
        with pytest.raises(PoolError) as failed:
            resume(directory, pool=pool, say=said.append)
        message = str(failed.value)
        assert len(message.splitlines()) == 1 and "namespace-1.pkl" in message
        assert ("nothing was changed" in message or "keeps going" in message) and said == []
        assert pool.started and pool.run("kept").value == {"text/plain": "7"}


class _Runs:
    """A pickle that runs a command when loaded: what an altered suspend file would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("part", ["namespace-1.pkl", "model.pkl", "spec.json", "manifest.json"])
def test_an_altered_suspend_runs_nothing_and_is_refused_in_one_line(part: str, tmp_path: Path) -> None:
    """A file of a suspend replaced by one that runs a command when loaded (the manifest rewritten
    to match it, for the manifest's case): the resume is refused before anything is loaded, the
    command never runs, and the running pool keeps its state."""
    import pickle

    directory = tmp_path / "run"
    marker = tmp_path / "ran"
    with _pool(2) as pool:
        _first_suspend(pool, directory)
        hostile = pickle.dumps(_Runs(marker))
        if part == "manifest.json":
            manifest = json.loads((directory / part).read_text())
            manifest["digests"]["namespace-1.pkl"] = __import__("hashlib").sha256(hostile).hexdigest()
            (directory / "namespace-1.pkl").write_bytes(hostile)
            (directory / part).write_text(json.dumps(manifest))
        else:
            (directory / part).write_bytes(hostile)
        pool.run("kept = 7")
        with pytest.raises(PoolError) as refused:
            resume(directory, pool=pool)
        message = str(refused.value)
        assert len(message.splitlines()) == 1
        assert (
            "signed" in message or "signature" in message or "does not match its signed manifest" in message
        )
        assert not marker.exists()
        # refused in the kernel, before the pool was let go
        assert pool.started and pool.run("kept").value == {"text/plain": "7"}
    assert not marker.exists()


def test_a_suspend_another_user_could_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with _pool(2) as pool:
        _first_suspend(pool, directory)
        (directory / "state").chmod(0o777)
        with pytest.raises(PoolError, match=r"/state can be written by another user.*chmod go-w -R"):
            resume(directory, pool=pool)
        assert pool.started


def test_an_altered_tensor_file_is_found_by_the_ranks_before_any_loads(tmp_path: Path) -> None:
    """DCP's tensor files are checked by the ranks as they resume (each file by one rank, all ranks
    agreeing before any loads): an altered one stops the resume in one line naming it."""
    directory = tmp_path / "run"
    with _pool(2) as pool:
        _first_suspend(pool, directory)
    shard = next((directory / "state").glob("__1_*"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PoolError) as refused:
        resume(directory)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert f"state/{shard.name} of this suspend does not match its signed manifest" in message


SLOW_TO_PICKLE = """
import time
class Slow:
    def __reduce__(self):
        time.sleep(60)
        return (int, ())
slow = Slow()
"""


def test_f22_ctrl_c_stops_a_long_suspend_with_its_live_line_and_keeps_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A suspend still pickling after 3 s shows its live line; Ctrl-C (SIGINT to the kernel) stops
    it in one line, leaves no temporary directory and the ranks with their state."""
    import os
    import signal
    import threading
    import time

    from jupyter_shard.pool import disk_progress

    monkeypatch.setattr(disk_progress, "QUIET_FOR", 1.0)
    directory = tmp_path / "run"
    with _pool(2) as pool:
        pool.run(SETUP + SLOW_TO_PICKLE)
        timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        began = time.monotonic()
        with pytest.raises(
            PoolError, match=r"^the suspend failed: stopped by Ctrl-C; the ranks keep running"
        ):
            suspend(pool, directory)
        assert time.monotonic() - began < 30
        assert "suspending: " in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []
        pool.run("del slow")
        assert pool.run("kept + 1").value == {"text/plain": "42"}
