"""Shared fixtures: a real IPython kernel driven through jupyter_client, with its output collected.

Every kernel started here is shut down (and, if needed, killed) by the fixture's finaliser, and each
test gets its own log directory so rank logs can be inspected.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager


@dataclass
class CellRun:
    reply: dict[str, Any]
    outputs: list[dict[str, Any]] = field(default_factory=list)
    elapsed: float = 0.0
    prompts: list[str] = field(default_factory=list)  # the input requests answered, in order

    @property
    def ok(self) -> bool:
        return bool(self.reply["content"]["status"] == "ok")

    def stream(self, name: str = "stdout") -> str:
        return "".join(o["text"] for o in self.outputs if o["type"] == "stream" and o["name"] == name)

    @property
    def error(self) -> dict[str, Any]:
        errors = [o for o in self.outputs if o["type"] == "error"]
        assert errors, f"no error output; outputs: {self.outputs}"
        return errors[0]

    def error_text(self) -> str:
        return "\n".join(self.error["traceback"])

    def data(self, kind: str = "display_data") -> list[dict[str, Any]]:
        return [o["data"] for o in self.outputs if o["type"] == kind]


class Kernel:
    """A kernel subprocess running this interpreter, plus a blocking client."""

    def __init__(self, log_dir: Path) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        env = {**os.environ, "JUPYTER_SHARD_LOG_DIR": str(log_dir), "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.closed = False
        self.messages: list[tuple[float, dict[str, Any]]] = []  # every iopub message read, with its time

    @property
    def pid(self) -> int:
        provisioner = self.km.provisioner
        assert provisioner is not None
        return int(provisioner.process.pid)  # type: ignore[attr-defined]

    def execute(self, code: str, timeout: float = 120.0, on_output: Any = None, stdin: Any = None) -> CellRun:
        """Run ``code``; ``stdin`` (``(prompt, password) -> str``) answers input requests, which the
        execute request then allows (as JupyterLab does); without it, stdin is not allowed (as nbclient)."""
        started = time.monotonic()
        msg_id = self.kc.execute(code, allow_stdin=stdin is not None)
        run = CellRun(reply={})
        while True:
            msg = self._next(timeout) if stdin is None else self._next_or_answer(timeout, stdin, run)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            content = msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind in ("stream", "display_data", "execute_result", "error", "update_display_data"):
                run.outputs.append({"type": kind, **content})
                if on_output is not None:
                    on_output(run.outputs[-1])
        run.reply = self.kc.get_shell_msg(timeout=timeout)
        while run.reply["parent_header"].get("msg_id") != msg_id:
            run.reply = self.kc.get_shell_msg(timeout=timeout)
        run.elapsed = time.monotonic() - started
        return run

    def _next_or_answer(self, timeout: float, stdin: Any, run: CellRun) -> dict[str, Any]:
        """The next iopub message, answering input requests while waiting for it."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                request = self.kc.get_stdin_msg(timeout=0)
            except queue.Empty:
                pass
            else:
                content = request["content"]
                run.prompts.append(content["prompt"])
                answer = stdin(content["prompt"], content["password"])
                if answer is not None:  # None: leave the prompt unanswered
                    self.kc.input(answer)
            try:
                return self._next(0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise

    def _next(self, timeout: float) -> dict[str, Any]:
        msg: dict[str, Any] = self.kc.get_iopub_msg(timeout=timeout)
        self.messages.append((time.monotonic(), msg))
        return msg

    def drain(self, seconds: float) -> list[dict[str, Any]]:
        """Read iopub for ``seconds`` (output of background work arrives while the kernel is idle)."""
        import queue

        deadline, got = time.monotonic() + seconds, []
        while (left := deadline - time.monotonic()) > 0:
            try:
                got.append(self._next(left))
            except queue.Empty:
                break
        return got

    def comm_updates(self, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        """Widget state updates (``comm_msg`` with method ``update``) read since ``since``."""
        return [
            (t, m)
            for t, m in self.messages
            if t >= since and m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"
        ]

    def shutdown(self) -> None:
        """Ask the kernel to shut down as Jupyter does; kill it if it does not. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.kc.stop_channels()
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)


@pytest.fixture
def kept_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private runtime directory (Unix socket paths are short) for this test's kept pools
    alone; any still kept at the end are stopped."""
    from jupyter_shard.env import RUNTIME_DIR_VAR
    from jupyter_shard.pool.keep import kept_pools, stop

    path = Path(tempfile.mkdtemp(prefix="js-keep-"))
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(path))
    yield path
    for kept in kept_pools():
        stop(kept.id, force=True)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def kernel_factory(log_dir: Path) -> Iterator[Any]:
    kernels: list[Kernel] = []

    def make() -> Kernel:
        k = Kernel(log_dir)
        kernels.append(k)
        return k

    yield make
    for k in kernels:
        k.shutdown()


@pytest.fixture
def kernel(kernel_factory: Any) -> Kernel:
    k: Kernel = kernel_factory()
    return k


@pytest.fixture(scope="module")
def shared_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One kernel with a 2-rank pool for a module of tests that only read or add rank state."""
    k = Kernel(tmp_path_factory.mktemp("logs"))
    run = k.execute("%load_ext jupyter_shard")
    assert run.ok, run.outputs
    yield k
    k.shutdown()


@pytest.fixture(autouse=True, scope="session")
def suspend_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Suspends made by the tests are signed with a key of the test session's, not the user's own
    (kernels the tests start inherit it)."""
    from jupyter_shard.pool.suspend_seal import KEY_DIR_VAR

    path = tmp_path_factory.mktemp("suspend-key")
    path.chmod(0o700)
    saved = os.environ.get(KEY_DIR_VAR)
    os.environ[KEY_DIR_VAR] = str(path)
    yield path
    if saved is None:
        os.environ.pop(KEY_DIR_VAR, None)
    else:
        os.environ[KEY_DIR_VAR] = saved


# -- under CI, a missing package fails its tests instead of skipping them ------------------------


def _missing_package(report: Any) -> bool:
    """A skip because a package did not import (``pytest.importorskip``)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    return "could not import" in reason


def _fail_missing(report: Any) -> None:
    if os.environ.get("CI") and report.skipped and _missing_package(report):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{reason} (CI installs every extra: this skip would hide the tests that need it)"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: Any) -> Iterator[None]:
    outcome = yield
    _fail_missing(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    outcome = yield
    _fail_missing(outcome.get_result())  # type: ignore[attr-defined]


def late_last(items: list[Any]) -> list[Any]:
    """``items`` with those marked ``late`` moved after all the others, each group in its order.

    ``make test`` builds DeepSpeed's CPU ops in the background at low priority (.ci/build_ops.py)
    instead of making the suites wait for them: a test that needs the op built last (async_io, 7 min
    of compiling on 2 cores) is marked ``late`` so the build has the suites' idle time to finish. A
    test that reaches an op still building waits for it, as a notebook would (one live line)."""
    return sorted(items, key=lambda item: item.get_closest_marker("late") is not None)  # (a stable sort)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = late_last(items)
