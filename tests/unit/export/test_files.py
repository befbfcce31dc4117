"""jupyter_shard.export.files: export() writes the script, its data files and the sbatch file, or refuses."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from jupyter_shard.export import render as export_module
from jupyter_shard.export.files import export
from jupyter_shard.spec import LaunchSpec, SpecError
from tests.unit.export._helpers import _cell, _push, _run_script, _transcript


def test_a_value_over_the_limit_goes_to_a_file_beside_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    big = b"\x01" * (export_module.SIDECAR_OVER + 10)
    script = tmp_path / "train.py"
    message = export(
        _transcript(_push(big=big), _push(big=b"x" * 2**21), _cell("n = len(big)", 1)), LaunchSpec(), script
    )
    data = tmp_path / "train.py.data"
    assert sorted(p.name for p in data.iterdir()) == ["big-2.pkl", "big.pkl"]
    assert pickle.loads((data / "big.pkl").read_bytes()) == big
    text = script.read_text()
    assert 'big = unpickle_file(__file__, "train.py.data/big.pkl")  # bytes, 1.0 MiB' in text
    assert len(text) < 10_000 and "2 large values in" in message
    ns = _run_script(text, 0, monkeypatch, tmp_path)
    assert ns["n"] == 2**21


def test_export_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    script, job = tmp_path / "train.py", tmp_path / "job.sbatch"
    script.write_text("mine\n")
    t = _transcript(_cell("x = 1", 1))
    with pytest.raises(SpecError, match=r"train\.py exists; add --force to overwrite it"):
        export(t, LaunchSpec(), script, sbatch=job)
    assert script.read_text() == "mine\n" and not job.exists()  # nothing written on a refusal
    job.write_text("job\n")
    with pytest.raises(SpecError, match=r"job\.sbatch exists"):
        export(t, LaunchSpec(), tmp_path / "other.py", sbatch=job)
    assert not (tmp_path / "other.py").exists()
    export(t, LaunchSpec(), script, sbatch=job, force=True)
    assert "x = 1" in script.read_text() and "#SBATCH" in job.read_text()
    assert script.stat().st_mode & 0o777 != 0o600  # as open() would make it, not the temp file's mode


def test_force_removes_data_files_the_new_export_no_longer_uses(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    big = b"\x02" * (export_module.SIDECAR_OVER + 1)
    export(_transcript(_push(big=big), _cell("x = 1", 1)), LaunchSpec(), script)
    assert (tmp_path / "train.py.data" / "big.pkl").exists()
    export(_transcript(_cell("x = 1", 1)), LaunchSpec(), script, force=True)
    assert not (tmp_path / "train.py.data").exists()


def test_nothing_to_export_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no %%distributed cell has run since the pool started"):
        export(_transcript(_push(lr=1)), LaunchSpec(), tmp_path / "train.py")
    with pytest.raises(SpecError, match="all 1 cell since"):
        export(_transcript(_cell("boom()", 1, status="error")), LaunchSpec(), tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()
