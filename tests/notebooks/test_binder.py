"""The Binder environment, built from ``binder/`` alone in a fresh virtual environment, runs the quickstart.

As repo2docker does: ``pip install -r binder/requirements.txt`` from the repository root, on top of
JupyterLab (which the Binder image already has). Then the quickstart is executed headlessly with
that environment's Python and must print the per-rank lines. Slow (a few minutes: torch and the
package are installed from scratch), so it is marked ``slow``; CI runs it.
"""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_binder_environment_runs_the_quickstart(tmp_path: Path) -> None:
    env_dir = tmp_path / "binder-env"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        {"PIP_PROGRESS_BAR": "off", "PIP_RETRIES": "1", "JUPYTER_SHARD_LOG_DIR": str(tmp_path / "logs")}
    )
    env["CUDA_VISIBLE_DEVICES"] = ""  # a Binder machine has no GPU: the quickstart runs on 2 CPU ranks
    _run([python, "-m", "pip", "install", "-r", "binder/requirements.txt", "jupyterlab"], ROOT, env, 900)
    check = _run(
        [python, "-c", "import torch, jupyter_shard; print(torch.__version__, jupyter_shard.__file__)"],
        tmp_path,
        env,
        120,
    )
    version, location = check.stdout.split()
    assert version.startswith("2.13.0") and "cu" not in version.split("+")[-1], version
    assert location.startswith(str(env_dir)), f"the package must come from the Binder environment: {location}"
    notebooks = ROOT / "notebooks"
    run = _run(
        [python, str(notebooks / "run_headless.py"), str(notebooks / "00_quickstart.ipynb")],
        tmp_path,
        env,
        300,
    )
    assert "[rank 0] rank 0 of 2 on cpu: all_reduce sum = 3" in run.stdout
