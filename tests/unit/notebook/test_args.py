"""jupyter_shard.notebook.args: the ``%dist_export`` line, parsed into one clear error or an export."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jupyter_shard.notebook.args import export_magic
from jupyter_shard.spec import LaunchSpec, SpecError
from tests.unit.export._helpers import _cell, _transcript


def test_the_magic_line_is_parsed_into_one_clear_error(tmp_path: Path) -> None:
    pool = SimpleNamespace(transcript=_transcript(_cell("x = 1", 1)), spec=LaunchSpec())
    with pytest.raises(SpecError, match=r"usage: %dist_export train\.py"):
        export_magic("", pool)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="unknown option '--nope'"):
        export_magic(f"{tmp_path / 't.py'} --nope", pool)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"directory .* does not exist"):
        export_magic(f"{tmp_path / 'no' / 't.py'}", pool)  # type: ignore[arg-type]
    message = export_magic(f"{tmp_path / 't.py'} --sbatch {tmp_path / 'j.sbatch'}", pool)  # type: ignore[arg-type]
    assert message.startswith(f"jupyter_shard: wrote {tmp_path / 't.py'} (1 cell, in the order they ran)")
    assert "`torchrun --nproc-per-node 2 t.py`" in message and "`sbatch j.sbatch`" in message
