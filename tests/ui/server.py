"""A real JupyterLab server for the browser tests, isolated from the user's Jupyter settings.

The server runs from this interpreter's environment (the venv), so its labextensions (ipywidgets'
widget manager) and its ``python3`` kernel are the ones under test. Config, data and runtime
directories are fresh temp directories, so the user's settings and workspaces do not leak in; the
only settings written there turn off what would get in the way of a test (the news prompt, cell
windowing, which leaves offscreen cells out of the DOM). :func:`stop` shuts down the kernels and
kills every process the server started, whatever state they are in.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

START_TIMEOUT = 90.0
STOP_TIMEOUT = 20.0

# User settings written into the temp config dir, by plugin id.
SETTINGS: dict[str, dict[str, Any]] = {
    # No "Would you like to get notified about official Jupyter news?" toast over the notebook.
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # Every cell stays in the DOM, so outputs of offscreen cells can be read.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


@dataclass
class LabServer:
    url: str
    token: str
    root_dir: Path
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    def api(self, method: str, path: str) -> Any:
        """Call the server's REST API; the decoded JSON reply (None when empty)."""
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def lab_url(self, workspace: str, notebook: str) -> str:
        """A fresh workspace (``?reset``) with only ``notebook`` open."""
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

    def notebook7_url(self, notebook: str) -> str:
        """``notebook`` in Notebook 7's single-document page, which the same server serves."""
        return f"{self.url}/notebooks/{notebook}?token={self.token}"

    def shutdown_kernels(self) -> None:
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _write_settings(config_dir: Path) -> None:
    for plugin, values in SETTINGS.items():
        path = config_dir / "lab" / "user-settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _copy_notebooks(source: Path, root_dir: Path) -> None:
    """Plain files only: a notebook folder may hold sockets left by a kernel (``kernel-ipc-*``)."""
    root_dir.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and not path.is_socket():
            shutil.copy2(path, root_dir / path.name)


def start(notebooks: Path, tmp: Path, artifacts: Path, env: dict[str, str]) -> LabServer:
    """Start ``jupyter lab`` on a copy of ``notebooks``; return once ``/api/status`` answers."""
    root_dir = tmp / "root"
    _copy_notebooks(notebooks, root_dir)
    jupyter_env = {
        **env,
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_DATA_DIR": str(tmp / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
    }
    _write_settings(tmp / "config")
    token, port = secrets.token_hex(16), _free_port()
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        f"--IdentityProvider.token={token}", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
        "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root_dir}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        # window.jupyterapp: the tests read cell output models and kernel state through it.
        "--LabApp.expose_app_in_browser=True", "--JupyterNotebookApp.expose_app_in_browser=True",
    ]  # fmt: skip
    if os.getuid() == 0:
        cmd.append("--allow-root")
    log = (artifacts / "jupyter-lab.log").open("wb")
    process = subprocess.Popen(
        cmd, cwd=root_dir, env=jupyter_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = LabServer(f"http://127.0.0.1:{port}", token, root_dir, process, log)
    try:
        _wait_ready(server)
    except BaseException:
        stop(server)
        raise
    return server


def _wait_ready(server: LabServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            server.api("GET", "/api/status")
            return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"jupyter lab did not answer in {START_TIMEOUT:.0f} s; see {server.log.name}")
        try:
            returncode = server.process.wait(timeout=0.2)  # also the interval between two tries
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"jupyter lab exited with {returncode}; see {server.log.name}")


def stop(server: LabServer) -> None:
    """Shut down the kernels, stop the server, then kill whatever it started that is still alive."""
    family = _family(server.process.pid)
    try:
        if server.process.poll() is None:
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                server.shutdown_kernels()
            server.process.send_signal(signal.SIGTERM)  # the server's own clean shutdown
            try:
                server.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
    finally:
        _kill_all(family)
        server.log.close()


def _family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process below it (kernels, and the rank processes they started)."""
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_all(processes: list[psutil.Process]) -> None:
    """Kill ``processes`` and any children they have now; wait until they are gone."""
    everyone = {proc.pid: proc for proc in processes}
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            everyone.update((child.pid, child) for child in proc.children(recursive=True))
    for proc in everyone.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(everyone.values()), timeout=STOP_TIMEOUT)
