"""nbval (``pytest --nbval notebooks``): the dashboard's figures are not compared.

A training cell's dashboard is stored as its final Plotly figure while nbval sees its first draw, and
both hold timings and memory; nbval would compare their JSON as is. Its HTML and text twin are still
compared, reduced to one marker by ``tests/notebooks/nbval_sanitize.cfg``.

A cell may run for up to :data:`CELL_TIMEOUT` seconds, against 120 s for a test: a guard against a
hang, not a speed check. The picker's dry run of six plans on a 1B-parameter model
(``06_choosing_a_strategy.ipynb``) ran past 120 s on an AMD EPYC with 2 cores, alone.

The kernels run with ``JUPYTER_SHARD_PROGRESS=0`` (set around each notebook cell's setup, where
nbval starts a notebook's kernel, and taken away after: other suites in the same run check the
line). A live progress line appears only for work that runs past a few seconds, so whether a stored
output holds one depends on the machine (a resume at 3 ranks in ``08_keep_suspend_resume.ipynb``
left one on a slower machine and failed the comparison).
"""

from __future__ import annotations

import os

import pytest

from jupyter_shard.env import PROGRESS_SWITCH

CELL_TIMEOUT = 300
FIGURES = ("application/vnd.jupyter-shard.figure+json", "application/vnd.plotly.v1+json")
_BEFORE = pytest.StashKey[str | None]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from nbval.plugin import IPyNbFile

    for item in items:
        notebook = item.parent
        if isinstance(notebook, IPyNbFile):
            item.add_marker(pytest.mark.timeout(CELL_TIMEOUT))
            if FIGURES[0] not in notebook.skip_compare:
                notebook.skip_compare = (*notebook.skip_compare, *FIGURES)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = os.environ.get(PROGRESS_SWITCH)
    os.environ[PROGRESS_SWITCH] = "0"  # a kernel nbval starts now inherits it


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _BEFORE not in item.stash:  # this item's setup never set it
        return
    before = item.stash[_BEFORE]
    if before is None:
        os.environ.pop(PROGRESS_SWITCH, None)
    else:
        os.environ[PROGRESS_SWITCH] = before
