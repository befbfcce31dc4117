"""Browser tests: a real JupyterLab server and Debian's Chromium driven by Playwright.

One server and one browser serve the whole ``tests/ui`` package; each test gets its own browser
context and JupyterLab workspace, and its kernels (with their rank pools) are shut down after it.
Screenshots, the server's log and each test's browser console go to ``test-artifacts/ui/``; a
failing test leaves a ``<test>-failed.png`` there.

Without Chromium or the ``playwright`` package the tests are skipped, except under ``CI=true``,
where they fail: CI installs both.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

from tests.ui import server as lab
from tests.ui.notebook import Notebook, open_notebook

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Error, ViewportSize

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts" / "ui"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT: ViewportSize = {"width": 1400, "height": 1000}

OpenNotebook = Callable[[str], Notebook]
_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI installs it: see .ci/run)", pytrace=False)
    pytest.skip(reason)


def _chromium() -> str:
    """``$CHROMIUM`` if set, else Debian's ``chromium`` (never a browser Playwright downloads)."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        _unavailable(f"no Chromium at {path} (apt-get install chromium, or set CHROMIUM to its path)")
    return path


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep the call phase's report on the item, for the failure screenshot."""
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


@pytest.fixture(scope="package")
def artifacts() -> Path:
    """``test-artifacts/ui/``, emptied first: what it holds is from this run only."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="package")
def lab_server(
    browser: Browser, tmp_path_factory: pytest.TempPathFactory, artifacts: Path
) -> Iterator[lab.LabServer]:
    """JupyterLab on a temp copy of ``notebooks/``; the browser is checked first, to skip early."""
    env = dict(os.environ)
    env.setdefault("JUPYTER_SHARD_LOG_DIR", str(artifacts / "rank-logs"))
    server = lab.start(NOTEBOOKS, tmp_path_factory.mktemp("lab"), artifacts, env)
    yield server
    lab.stop(server)


@pytest.fixture
def open_nb(
    request: pytest.FixtureRequest, browser: Browser, lab_server: lab.LabServer, artifacts: Path
) -> Iterator[OpenNotebook]:
    """``open_nb("00_quickstart.ipynb")``: that notebook, alone in a fresh JupyterLab workspace and tab."""
    prefix = re.sub(r"[^\w.-]+", "_", request.node.name)
    yield from _opener(request, browser, lab_server, artifacts, lambda path: lab_server.lab_url(prefix, path))


@pytest.fixture
def open_nb7(
    request: pytest.FixtureRequest, browser: Browser, lab_server: lab.LabServer, artifacts: Path
) -> Iterator[OpenNotebook]:
    """``open_nb7("00_quickstart.ipynb")``: that notebook in Notebook 7, served by the same server."""
    if importlib.util.find_spec("notebook") is None:
        _unavailable("Notebook 7 is not installed (pip install -e '.[lab]')")
    yield from _opener(request, browser, lab_server, artifacts, lab_server.notebook7_url)


def _opener(
    request: pytest.FixtureRequest,
    browser: Browser,
    lab_server: lab.LabServer,
    artifacts: Path,
    url_for: Callable[[str], str],
) -> Iterator[OpenNotebook]:
    """Open notebooks in a fresh browser context; on failure a screenshot; then stop the kernels."""
    prefix = re.sub(r"[^\w.-]+", "_", request.node.name)
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    console = (artifacts / f"{prefix}-console.log").open("w")

    def log_message(message: ConsoleMessage) -> None:
        console.write(f"{message.type}: {message.text}\n")

    def log_error(error: Error) -> None:
        console.write(f"pageerror: {error}\n")

    page.on("console", log_message)
    page.on("pageerror", log_error)

    def open_(path: str) -> Notebook:
        assert (lab_server.root_dir / path).is_file(), f"no {path} in notebooks/"
        return open_notebook(page, url_for(path), path, artifacts, prefix)

    try:
        yield open_
    finally:
        report = request.node.stash.get(_CALL_REPORT, None)
        if report is not None and report.failed:
            page.screenshot(path=artifacts / f"{prefix}-failed.png")
        context.close()
        console.close()
        lab_server.shutdown_kernels()  # and with them the rank pools they started
