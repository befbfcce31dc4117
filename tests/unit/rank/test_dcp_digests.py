"""Each checkpoint file is hashed as DCP writes it: the digests equal those of the files read back
(tensors and a pickled value, the metadata renamed from its temporary name), and a file the writer
did not see written is hashed from disk."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from jupyter_shard._util.digests import digest_file
from jupyter_shard.rank import dcp_digests
from jupyter_shard.rank.dcp_digests import HashingWriter, digests_of, without_crc32


def test_the_digests_of_a_written_checkpoint_are_those_of_its_files(tmp_path: Path) -> None:
    # "big" is written in pieces over dcp_digests.PARALLEL, hashed on the second thread
    state = {
        "w": torch.randn(256, 64),
        "big": torch.randn(3 << 20),
        "b": torch.arange(10.0),
        "step": {"n": 7, "note": "x"},
    }
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


def test_large_writes_are_hashed_alongside_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    seen: list[int] = []
    real = dcp_digests._hasher

    def hasher() -> object:
        seen.append(1)
        return real()

    monkeypatch.setattr(dcp_digests, "_hasher", hasher)
    raw = io.BytesIO()
    stream = dcp_digests._HashingStream(raw)
    pieces = [b"a" * 10, bytes(range(256)) * 8192, b"b" * 5, b"c" * (dcp_digests.PARALLEL + 3)]
    for piece in pieces:
        assert stream.write(piece) == len(piece)
    assert len(seen) == 2  # the two pieces of 1 MiB or more
    assert (
        stream.sha.hexdigest()
        == hashlib.sha256(b"".join(pieces)).hexdigest()
        == hashlib.sha256(raw.getvalue()).hexdigest()
    )


def test_without_crc32_writes_zip_records_torch_reads_and_restores_the_setting() -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    t = torch.randn(1000)
    with without_crc32():
        assert config.save.compute_crc32 is False
        buffer = io.BytesIO()
        torch.save(t, buffer)
    assert config.save.compute_crc32 == before
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        assert {i.CRC for i in archive.infolist() if i.filename.endswith("data/0")} == {0}
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True), t)
