"""Records read without following links and only when private: the race a symlink swap won is gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jupyter_shard._util.atomic import write_private
from jupyter_shard._util.private_files import NotPrivate, read_private_json


def record(tmp_path: Path) -> Path:
    directory = tmp_path / "jupyter_shard-abcdefgh"
    directory.mkdir(mode=0o700)
    write_private(directory / "kept.json", json.dumps({"owner": None}))
    return directory / "kept.json"


def test_a_private_record_is_read(tmp_path: Path) -> None:
    assert read_private_json(record(tmp_path)) == {"owner": None}


def test_a_linked_directory_or_file_is_never_followed(tmp_path: Path) -> None:
    real = record(tmp_path)
    forged = tmp_path / "forged"
    forged.mkdir(mode=0o700)
    write_private(forged / "kept.json", json.dumps({"processes": [[1, None]]}))
    swapped = tmp_path / "jupyter_shard-swapped"
    swapped.symlink_to(forged)  # the directory swapped for another's
    with pytest.raises(OSError):
        read_private_json(swapped / "kept.json")
    (real.parent / "other.json").symlink_to(forged / "kept.json")  # the file swapped
    with pytest.raises(OSError):
        read_private_json(real.parent / "other.json")


@pytest.mark.parametrize("which", ["directory", "file"])
def test_a_record_others_can_reach_is_refused(which: str, tmp_path: Path) -> None:
    path = record(tmp_path)
    (path.parent if which == "directory" else path).chmod(0o755 if which == "directory" else 0o644)
    with pytest.raises(NotPrivate, match=f"is not this user's private {which}"):
        read_private_json(path)
