"""F11, F12, F13: start-up failures are fast and explained; stale state and a kernel torch are fine."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_shard import Pool, PoolError

pytestmark = pytest.mark.timeout(120)


def test_rank_failing_at_startup_fails_pool_start_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    started = time.monotonic()
    pool = Pool(nproc=2, device="cpu", log_dir=tmp_path / "logs")
    with pytest.raises(PoolError) as caught:
        pool.start()
    took = time.monotonic() - started
    message = str(caught.value)
    assert "failed to start" in message
    assert "ImportError: this torch is broken on purpose" in message
    assert took < 10, f"start-up failure took {took:.1f} s to report"
    assert not pool.started


def test_torch_imported_in_kernel_first(kernel: Any) -> None:
    run = kernel.execute("import torch\nx = torch.ones(3).sum()\n%load_ext jupyter_shard")
    assert run.ok
    run = kernel.execute("%%distributed --nproc 2 --device cpu\nshard.rank")
    assert run.data("execute_result") == [{"text/plain": "0"}]


def test_stale_pool_directory_is_cleaned_by_pid_and_start_time(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    unrelated = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    try:
        dead_kernel = subprocess.Popen([sys.executable, "-c", "pass"])
        dead_kernel.wait()
        stale = Path(tempfile.mkdtemp(prefix="jupyter_shard-"))
        record = {
            "kernel": [dead_kernel.pid, 1.0],
            "ranks": [
                [sleeper.pid, psutil.Process(sleeper.pid).create_time()],
                [unrelated.pid, 12345.0],  # pid recorded with another start time: not ours any more
            ],
        }
        (stale / "pool.json").write_text(json.dumps(record))
        with Pool(nproc=1, device="cpu", log_dir=tmp_path) as pool:
            assert pool.run("1").value == {"text/plain": "1"}
        assert sleeper.wait(timeout=5) == -9
        assert unrelated.poll() is None, "a process whose start time did not match was signalled"
        assert not stale.exists()
    finally:
        for proc in (sleeper, unrelated):
            proc.kill()
            proc.wait()
