"""jupyter_shard.rank.script: an exported script's ``shard.log`` metrics, JSON lines per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jupyter_shard.rank import script as script_module


def test_script_metrics_are_json_lines_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(script_module.METRICS_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run1")
    metrics = script_module._MetricsFile(script_module._metrics_path(1))
    helper = script_module._ScriptShard(1, 1, 2, torch.device("cpu"), "none", metrics, {})
    helper.log(loss=torch.tensor(0.5))  # the first record is written at once
    helper.log(loss=0.25, step=10)
    helper.log(acc=1)
    helper.flush_metrics()  # what finish() and exit do
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "run1" / "rank-1.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "time"} for r in lines] == [
        {"rank": 1, "step": 1, "loss": 0.5},
        {"rank": 1, "step": 10, "loss": 0.25},
        {"rank": 1, "step": 3, "acc": 1.0},
    ]
    assert all(isinstance(r["time"], float) for r in lines)


def test_script_metrics_that_cannot_be_written_go_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    metrics = script_module._MetricsFile(blocker / "rank-0.jsonl")  # a directory that cannot exist
    helper = script_module._ScriptShard(0, 0, 1, torch.device("cpu"), "none", metrics, {})
    helper.log(loss=2.0)
    err = capsys.readouterr().err
    assert "shard.log records not written" in err and '"loss": 2.0' in err


FINISHED = """
import atexit, sys
from jupyter_shard.rank.script import finish, start
shard = start()
atexit.register(lambda: print("exit handler ran", flush=True))
print("unflushed", end="")
finish()
print("after finish")
"""


def test_finish_runs_the_exit_handlers_flushes_and_ends_the_process(tmp_path: Path) -> None:
    """It leaves the process group and exits at once, as ranks do (no interpreter teardown, in which
    torch 2.13's gloo can abort the process after the script returned)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env[script_module.METRICS_ENV] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", FINISHED], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "unflushedexit handler ran\n", done.stdout
