"""A ``torch.distributed.checkpoint`` writer that hashes each file as it writes it.

A suspend's manifest lists the SHA-256 of every file (:mod:`jupyter_shard._util.digests`). Hashing
the checkpoint's files after DCP wrote them reads every byte a second time; this writer's file
system hands DCP a stream that hashes what passes through it, so the digest comes with the write.
A file it did not see written (a DCP that writes another way) is hashed after, as before.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from jupyter_shard._util.digests import digest_file
from jupyter_shard._util.writeback import Writeback

__all__ = ["HashingWriter", "digests_of", "without_crc32"]


PARALLEL = 1 << 20  # writes this large are hashed alongside the write

_pool: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jupyter_shard-hash")
    return _pool


class _HashingStream(io.IOBase):
    """A binary file being written: every byte also goes into a SHA-256."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.sha = hashlib.sha256()
        try:
            fd = int(raw.fileno())
        except (OSError, AttributeError, io.UnsupportedOperation):
            fd = -1  # not a file on disk: nothing to write back
        self.writeback = Writeback(fd)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if memoryview(data).nbytes < PARALLEL:
            self.sha.update(data)
            count = int(self.raw.write(data))
        else:  # hashed on another thread while this one writes (both let go of the GIL)
            hashed = _hasher().submit(self.sha.update, data)
            try:
                count = int(self.raw.write(data))
            finally:
                hashed.result()
        self.writeback.wrote(count)
        return count

    def tell(self) -> int:
        return int(self.raw.tell())

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # (flushes first)
            self.raw.close()


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}  # file name (its final one) -> SHA-256

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            hashing = _HashingStream(raw)
            yield hashing
            name = Path(path).name
            self.digests[name.removesuffix(".tmp")] = hashing.sha.hexdigest()  # .metadata is renamed


class HashingWriter(FileSystemWriter):
    """DCP's file system writer, hashing each file it writes (:func:`digests_of` reads them)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = _HashingFileSystem()


def digests_of(writer: HashingWriter, paths: list[Path]) -> dict[str, str]:
    """SHA-256 of each of ``paths`` (files the writer wrote) by name: as written, where the writer
    saw the bytes go by, else read back."""
    seen = writer.fs.digests if isinstance(writer.fs, _HashingFileSystem) else {}
    return {p.name: seen.get(p.name) or digest_file(p) for p in paths}


@contextmanager
def without_crc32() -> Generator[None, None, None]:
    """``torch.save`` without the CRC-32 of each zip record while the block runs: the SHA-256 above
    covers every byte already, and the CRC costs about half a second per GB on one core (torch 2.6
    and later read such files as any other; where the setting does not exist, nothing changes)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - older torch
        yield
        return
    save = getattr(config, "save", None)
    if save is None or not hasattr(save, "compute_crc32"):
        yield
        return
    kept = save.compute_crc32
    save.compute_crc32 = False
    try:
        yield
    finally:
        save.compute_crc32 = kept
