"""``python -m jupyter_shard``: the kept pools from a terminal, and one line when there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_shard.__main__ import main
from jupyter_shard.env import RUNTIME_DIR_VAR


def test_pools_and_stop_with_no_kept_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_VAR, str(tmp_path))
    assert main(["pools"]) == 0
    assert capsys.readouterr().out.startswith("no kept pools")
    assert main(["stop", "abcd"]) == 1
    assert capsys.readouterr().err.startswith("jupyter_shard: there is no kept pool on this machine")


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
