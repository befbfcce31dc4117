"""Ranks forked from the zygote: a process started with exec that imported torch once.

The zygote is the ranks' parent (never the kernel, which is only the zygote's parent, by exec); each
forked rank is a fresh session with its own random state; a restart forks new ranks from the same
zygote; a different interpreter environment gets its own zygote; ``JUPYTER_SHARD_ZYGOTE=0`` spawns
ranks instead; ranks whose zygote is killed are reported as such; a zygote that merely has the CUDA
driver library loaded forks, one whose driver was initialised (``cuInit``) refuses to; and the pool
says which way its ranks came (the first line of ``%dist_status``).
"""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from jupyter_shard import Pool, PoolError
from jupyter_shard.launchers import zygote
from jupyter_shard.pool.output import ConsoleSink
from tests.unit.launchers.zygote.test_cuda_driver import fake_driver

pytestmark = pytest.mark.timeout(120)

PROBE = (
    "import os, random, sys\n"
    "print(os.getpid(), os.getppid(), os.getsid(0), random.random(), 'torch' in sys.modules)"
)


def _probe(pool: Pool) -> dict[int, list[str]]:
    return {k: r.stdout.split() for k, r in pool.run(PROBE).ranks.items()}


def test_ranks_are_forked_by_an_execd_zygote_with_fresh_state(tmp_path: Path) -> None:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        seen = _probe(pool)
        pids = {int(v[0]) for v in seen.values()}
        parents = {int(v[1]) for v in seen.values()}
        assert len(parents) == 1
        (zygote_pid,) = parents
        z = psutil.Process(zygote_pid)
        assert z.ppid() == os.getpid()  # started by this process ...
        assert z.cmdline()[1:3] == ["-m", "jupyter_shard.launchers.zygote.server"]  # by exec, no fork
        assert all(int(v[2]) == int(v[0]) for v in seen.values())  # each rank leads its own session
        assert len({v[3] for v in seen.values()}) == 2  # random state reseeded in each child
        assert all(v[4] == "True" for v in seen.values())  # torch came preloaded
        pool.restart()
        again = _probe(pool)
        assert {int(v[1]) for v in again.values()} == {zygote_pid}  # the same zygote ...
        assert not pids & {int(v[0]) for v in again.values()}  # ... forked new ranks
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_another_interpreter_environment_gets_its_own_zygote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Pool(nproc=1, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        first = int(_probe(pool)[0][1])
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with Pool(nproc=1, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        second = int(_probe(pool)[0][1])
        assert pool.run("import sys; sys.flags.hash_randomization").ranks[0].result == {"text/plain": "0"}
    assert first != second


def test_switched_off_ranks_are_spawned_by_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(zygote.ENV_SWITCH, "0")
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        assert {int(v[1]) for v in _probe(pool).values()} == {os.getpid()}


def test_ranks_of_a_killed_zygote_are_reported_with_it(tmp_path: Path) -> None:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        zygote_pid = int(_probe(pool)[0][1])
        os.kill(zygote_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(r.state.value != "dead" for r in pool.status()) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(PoolError) as err:
            pool.run("pass")
        assert f"zygote pid {zygote_pid}, which ended" in str(err.value)
        pool.restart()  # a fresh zygote serves the restart
        assert int(_probe(pool)[0][1]) != zygote_pid


def test_status_says_which_way_the_ranks_came(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        zygote_pid = int(_probe(pool)[0][1])
        assert pool.launch_path == f"zygote (fork server, pid {zygote_pid})"
    assert pool.launch_path == "not started"
    monkeypatch.setenv(zygote.ENV_SWITCH, "0")
    with Pool(nproc=1, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        assert pool.launch_path == "spawned: JUPYTER_SHARD_ZYGOTE=0 turns the zygote off"


def _start_up_loads_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str) -> Path:
    """Make every new interpreter (the zygote's included) load a fake ``libcuda.so.1`` at start-up
    (a sitecustomize), as ``import torch`` does on a GPU machine, then run ``then`` with it as ``driver``."""
    fake = fake_driver(tmp_path / "lib")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import ctypes\ndriver = ctypes.CDLL({str(fake)!r})\n{then}\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return fake


def test_a_zygote_with_the_cuda_driver_loaded_but_not_initialised_forks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _start_up_loads_driver(tmp_path, monkeypatch, then="")
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:
        (zygote_pid,) = {int(v[1]) for v in _probe(pool).values()}
        assert zygote_pid != os.getpid()
        assert pool.launch_path == f"zygote (fork server, pid {zygote_pid})"


def test_a_zygote_holding_cuda_driver_state_refuses_and_status_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a start-up hook that called the driver (torch.cuda.is_available(), say) leaves in the zygote.
    fake = _start_up_loads_driver(tmp_path, monkeypatch, then="driver.cuInit(0)")
    err = io.StringIO()
    with Pool(nproc=2, device="cpu", log_dir=tmp_path, sink=ConsoleSink(io.StringIO(), err)) as pool:
        assert {int(v[1]) for v in _probe(pool).values()} == {os.getpid()}  # spawned by the kernel
        held = f"cuInit ran in {fake}: cuDeviceGetCount answers 0, not 3"
        why = f"the zygote refused to fork: it holds CUDA driver state after its imports ({held})"
        assert pool.launch_path == f"spawned: {why}"
        assert f"ranks were spawned, not forked from the zygote: {why}" in err.getvalue()
        assert pool.log_dir is not None and why in (pool.log_dir / "rank-0.log").read_text()
    with Pool(nproc=1, device="cpu", log_dir=tmp_path, sink=ConsoleSink()) as pool:  # remembered
        assert pool.launch_path == f"spawned: {why}"


def test_a_rank_forked_after_a_cd_puts_compile_debug_output_under_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote imports torch._dynamo, which fixes its debug directory from the working directory at
    import; a rank forked later, in another directory, has it under its own (where a spawned rank has it)."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.delenv("TORCH_COMPILE_DEBUG_DIR", raising=False)
    monkeypatch.chdir(first)
    probe = "import torch._dynamo\nprint(torch._dynamo.config.debug_dir_root)"
    with Pool(nproc=1, device="cpu", log_dir=tmp_path / "logs", sink=ConsoleSink()) as pool:
        assert pool.run(probe).ranks[0].stdout.strip() == str(first.resolve() / "torch_compile_debug")
        monkeypatch.chdir(second)
        pool.restart()
        assert pool.run(probe).ranks[0].stdout.strip() == str(second.resolve() / "torch_compile_debug")
