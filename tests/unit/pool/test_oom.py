"""Finding a process's memory-cgroup ``oom_kill`` counter, for cgroup v2 and v1 layouts."""

from __future__ import annotations

from pathlib import Path

from jupyter_shard.pool import oom

V2_MOUNTINFO = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = (
    "35 31 0:32 /outer /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
)


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc" / "7"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo.replace("/sys/fs/cgroup", str(tmp_path / "cg")))
    return tmp_path / "proc"


def test_cgroup_v2_memory_events(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/user.slice/job\n", V2_MOUNTINFO)
    events = tmp_path / "cg" / "user.slice" / "job" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert oom.counter_file(7, proc) == events
    assert oom.read_count(events) == 1
    assert oom.explain_sigkill(events, 1) == ""  # unchanged: not the OOM killer, as far as it tells
    events.write_text("oom 2\noom_kill 2\n")
    assert oom.explain_sigkill(events, 1) == (
        f"by the out-of-memory killer (the oom_kill count of its memory cgroup, {events}, went from 1 to 2)"
    )


def test_cgroup_v1_memory_controller_below_the_mount_root(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:cpu:/\n3:memory:/outer/inner\n", V1_MOUNTINFO)
    control = tmp_path / "cg" / "memory" / "inner" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert oom.counter_file(7, proc) == control
    assert oom.read_count(control) == 0


def test_nothing_readable_means_no_claim(tmp_path: Path) -> None:
    assert oom.counter_file(7, tmp_path / "no-proc") is None
    proc = _proc(tmp_path, "0::/gone\n", V2_MOUNTINFO)
    assert oom.counter_file(7, proc) is None  # the cgroup's file does not exist
    assert oom.read_count(None) is None
    assert oom.explain_sigkill(None, None) == ""
