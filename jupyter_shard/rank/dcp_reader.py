"""A ``torch.distributed.checkpoint`` reader that reads each whole tensor straight into its target.

Why it exists: DCP's file system reader loads every tensor of a checkpoint with ``torch.load`` into
a tensor of its own, then copies that into the tensor being restored: each byte is copied twice and
each page of memory faulted in twice. On a resume that was about a third of the load (1.1 s of copies
after 1.2 s of reads for 1.9 GB on one rank). :class:`DirectReader` reads a tensor's bytes from the
file into the target's memory in one ``readinto`` when nothing has to be reshaped on the way: the
saved tensor (its shape, strides and dtype read from the item's header, its data not loaded) is
contiguous, whole, of the target's dtype, on a little-endian machine, and the target is a contiguous
CPU tensor of the same shape. Every other item (a slice of a resharded tensor, a pickled value, a
transformed stream) goes through DCP's own reader, unchanged, as does every item on a torch before
2.7 (whose ``torch.load`` does not take ``skip_data``). The files are read only after the ranks
checked them against the signed manifest (:mod:`jupyter_shard.rank.state_check`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["DirectReader", "touch"]

TOUCH_MIN = 1 << 20  # tensors smaller than this are left to fault in as they are filled


def touch(state: Any) -> int:
    """Write zeros over every contiguous CPU tensor of ``state`` (a DCP state dict: tensors, DTensors,
    nested dicts and lists) of at least :data:`TOUCH_MIN` bytes, and nothing beyond each tensor's own
    elements (which the load then overwrites, as it does every tensor of the state dict); how many bytes.
    Memory a rank has just allocated is mapped on its first write, page by page, and mapping it while
    DCP copied a file into it made that copy 5 to 10 times slower (2 GB on this project's 2-core machine:
    0.35 s into memory written before, 1.6 to 4.0 s into fresh memory). A resume touches its targets
    while its files are still being checked, so the copy after the check only copies."""
    seen: set[int] = set()
    done = 0
    with torch.no_grad():
        for tensor in _tensors(state):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # (a DTensor's shard)
            if not isinstance(local, torch.Tensor) or local.device.type != "cpu":
                continue
            if local.layout != torch.strided:
                continue
            size = local.numel() * local.element_size()
            if size < TOUCH_MIN or not local.is_contiguous() or local.data_ptr() in seen:
                continue
            seen.add(local.data_ptr())
            local.detach().view(-1).zero_()
            done += size
    return done


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class DirectReader(FileSystemReader):
    """DCP's file system reader, with whole contiguous tensors read in place (see above), and DCP's
    metadata unpickled from ``metadata``, the bytes whose digest was checked, where they are given
    (not read from the path again)."""

    def __init__(self, path: str | os.PathLike[str], metadata: bytes | None = None) -> None:
        super().__init__(path)
        self._checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked_metadata is None:
            return super().read_metadata(*args, **kwargs)
        metadata: Metadata = pickle.loads(self._checked_metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id") and metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = getattr(self, "storage_data", None)
        skip_data = getattr(torch.serialization, "skip_data", None)
        if not isinstance(storage, dict) or skip_data is None or sys.byteorder != "little":
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        rest: list[ReadItem] = []
        for item in plan.items:
            info = storage[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                rest.append(item)
            else:
                per_file.setdefault(info.relative_path, []).append(item)
        for relative, items in per_file.items():
            path = self.fs.concat_path(self.path, relative)
            with open(path, "rb", buffering=0) as fh:
                for item in sorted(items, key=lambda i: storage[i.storage_index].offset):
                    if not _read_in_place(fh, item, storage[item.storage_index], planner, skip_data):
                        rest.append(item)
        if not rest:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


def _read_in_place(fh: Any, item: ReadItem, info: Any, planner: LoadPlanner, skip_data: Any) -> bool:
    """Read ``item`` into its target if it is a whole contiguous tensor of the target's shape and
    dtype; whether it did (False: nothing was changed)."""
    fh.seek(info.offset)
    header = cast(IO[bytes], _Window(fh, info.offset, info.length))
    try:
        with skip_data():
            saved = torch.load(header, map_location="cpu", weights_only=True)
        header.seek(0)
        archive: Any = torch._C.PyTorchFileReader(header)  # (its stubs lack has_record, get_record_offset)
        records = [r for r in archive.get_all_records() if r.startswith("data/")]
        byteorder = archive.get_record("byteorder") if archive.has_record("byteorder") else b"little"
        start = int(archive.get_record_offset("data/0")) if records == ["data/0"] else -1
    except Exception:
        return False
    if not isinstance(saved, torch.Tensor) or records != ["data/0"] or bytes(byteorder) != b"little":
        return False
    target = planner.resolve_tensor(item).detach()
    size = saved.numel() * saved.element_size()
    if (
        type(saved) is not torch.Tensor
        or not saved.is_contiguous()
        or saved.storage_offset() != 0
        or saved.untyped_storage().nbytes() != size
        or any(o != 0 for o in item.storage_offsets)
        or tuple(item.lengths) != tuple(saved.shape)
        or target.device.type != "cpu"
        or not target.is_contiguous()
        or target.dtype != saved.dtype
        or tuple(target.shape) != tuple(saved.shape)
    ):
        return False
    if start < 0 or start + size > info.length:
        return False
    try:
        out = target.reshape(-1).view(torch.uint8).numpy()  # the target's own memory, as bytes
    except Exception:  # (numpy missing or unusable: DCP's reader copies instead)
        return False
    fh.seek(info.offset + start)
    _fill(fh, out, size, item)
    planner.commit_tensor(item, target)
    return True


def _fill(fh: Any, out: Any, size: int, item: ReadItem) -> None:
    view = memoryview(out).cast("B")
    got = 0
    while got < size:
        count = fh.readinto(view[got:size])
        if not count:
            raise RuntimeError(f"the checkpoint file ended inside {item.storage_index.fqn}")
        got += count


class _Window(io.RawIOBase):
    """``length`` bytes of a file from ``offset``, as a seekable file of their own (one item)."""

    def __init__(self, fh: Any, offset: int, length: int) -> None:
        super().__init__()
        self._fh, self._offset, self._length, self._at = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, min(self._length, base + offset))
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._at)
        if count <= 0:
            return 0
        self._fh.seek(self._offset + self._at)
        got = int(self._fh.readinto(view[:count]) or 0)
        self._at += got
        return got
