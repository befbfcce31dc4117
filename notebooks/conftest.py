"""nbval (``pytest --nbval notebooks``): the dashboard's figures are not compared.

A training cell's dashboard is stored as its final Plotly figure while nbval sees its first draw, and
both hold timings and memory; nbval would compare their JSON as is. Its HTML and text twin are still
compared, reduced to one marker by ``tests/notebooks/nbval_sanitize.cfg``.
"""

from __future__ import annotations

import pytest

FIGURES = ("application/vnd.jupyter-shard.figure+json", "application/vnd.plotly.v1+json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from nbval.plugin import IPyNbFile

    for item in items:
        notebook = item.parent
        if isinstance(notebook, IPyNbFile) and FIGURES[0] not in notebook.skip_compare:
            notebook.skip_compare = (*notebook.skip_compare, *FIGURES)
