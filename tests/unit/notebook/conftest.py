"""An IPython shell for the notebook layer's unit tests: its own IPython folder, history in memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config


@pytest.fixture(scope="module")
def ipython(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InteractiveShell]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        yield InteractiveShell.instance(config=config)
