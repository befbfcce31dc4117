"""The key that signs suspends, and the spec stored as JSON (never a pickle the kernel loads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jupyter_shard import PoolError
from jupyter_shard.launchers import resolve_spec
from jupyter_shard.launchers.spec_record import from_record, to_record
from jupyter_shard.pool.suspend_seal import KEY_DIR_VAR, KEY_FILE, open_manifest, seal, user_key


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(KEY_DIR_VAR, str(tmp_path / "keys"))
    return tmp_path / "keys"


def test_the_key_is_made_once_private_and_a_shared_one_is_refused(keys: Path) -> None:
    key = user_key()
    assert len(key) == 32 and user_key() == key
    assert oct((keys / KEY_FILE).stat().st_mode & 0o777) == "0o600"
    assert oct(keys.stat().st_mode & 0o777) == "0o700"
    (keys / KEY_FILE).chmod(0o644)
    with pytest.raises(PoolError, match="is not this user's alone; remove it"):
        user_key()


def test_a_manifest_is_read_only_with_its_signature(keys: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    data = json.dumps({"format": 2}).encode()
    (run / "manifest.json").write_bytes(data)
    (run / "manifest.sig").write_bytes(seal(run, data))
    assert open_manifest(run) == {"format": 2}
    (run / "manifest.json").write_bytes(json.dumps({"format": 2, "x": 1}).encode())
    with pytest.raises(PoolError, match="is not signed by this user's key"):
        open_manifest(run)
    (run / "manifest.json").write_bytes(data)
    os.environ[KEY_DIR_VAR] = str(tmp_path / "other-user")  # another key: another user or machine
    with pytest.raises(PoolError, match="is not signed by this user's key"):
        open_manifest(run)


@pytest.mark.parametrize(
    "spec",
    [
        resolve_spec(nproc=3, device="cpu", strategy="fsdp", precision="bf16-mixed", accumulate=4),
        resolve_spec("torchrun", nodes=2, nproc=2, device="cpu", strategy="ddp", hosts=("a", "b")),
        resolve_spec("slurm", nproc=2, device="cpu", strategy="deepspeed", zero_stage=3, partition="p"),
    ],
)
def test_a_spec_goes_through_json_and_back_unchanged(spec: object) -> None:
    record = json.loads(json.dumps(to_record(spec)))  # type: ignore[arg-type]
    assert from_record(record) == spec


@pytest.mark.parametrize(
    "change",
    [{"nproc": "2; import os"}, {"device": "gpu"}, {"launcher_options": {"evil": 1}}, {"env": [["A"]]}],
)
def test_a_spec_record_that_is_not_one_is_refused(change: dict[str, object]) -> None:
    record = to_record(resolve_spec(nproc=2, device="cpu", strategy="ddp")) | change
    with pytest.raises(ValueError):
        from_record(record)
