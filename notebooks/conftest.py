"""nbval (``pytest --nbval notebooks``): the dashboard's figures are not compared.

A training cell's dashboard is stored as its final Plotly figure while nbval sees its first draw, and
both hold timings and memory; nbval would compare their JSON as is. Its HTML and text twin are still
compared, reduced to one marker by ``tests/notebooks/nbval_sanitize.cfg``.

A cell may run for up to :data:`CELL_TIMEOUT` seconds, against 120 s for a test: a guard against a
hang, not a speed check. The picker's dry run of six plans on a 1B-parameter model
(``06_choosing_a_strategy.ipynb``) ran past 120 s on an AMD EPYC with 2 cores, alone.
"""

from __future__ import annotations

import pytest

CELL_TIMEOUT = 300
FIGURES = ("application/vnd.jupyter-shard.figure+json", "application/vnd.plotly.v1+json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from nbval.plugin import IPyNbFile

    for item in items:
        notebook = item.parent
        if isinstance(notebook, IPyNbFile):
            item.add_marker(pytest.mark.timeout(CELL_TIMEOUT))
            if FIGURES[0] not in notebook.skip_compare:
                notebook.skip_compare = (*notebook.skip_compare, *FIGURES)
