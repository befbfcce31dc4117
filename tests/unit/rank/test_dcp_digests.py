"""Each checkpoint file is hashed as DCP writes it: the digests equal those of the files read back
(tensors and a pickled value, the metadata renamed from its temporary name), and a file the writer
did not see written is hashed from disk."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from jupyter_shard._util.digests import digest_file
from jupyter_shard.rank.dcp_digests import HashingWriter, digests_of


def test_the_digests_of_a_written_checkpoint_are_those_of_its_files(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 64), "b": torch.arange(10.0), "step": {"n": 7, "note": "x"}}
    writer = HashingWriter(tmp_path)
    dcp_save(state, storage_writer=writer, checkpoint_id=tmp_path, no_dist=True)
    files = sorted(p for p in tmp_path.iterdir() if p.is_file())
    assert {p.name for p in files} >= {".metadata"} and len(files) >= 2
    assert set(writer.fs.digests) == {p.name for p in files}  # every file seen as it was written
    assert digests_of(writer, files) == {p.name: digest_file(p) for p in files}


def test_a_file_the_writer_did_not_see_is_hashed_from_disk(tmp_path: Path) -> None:
    other = tmp_path / "other.bin"
    other.write_bytes(b"not written by DCP")
    assert digests_of(HashingWriter(tmp_path), [other]) == {"other.bin": digest_file(other)}
