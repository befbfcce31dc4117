"""jupyter_shard.transfer.mapping: writable mappings, private over a file, freed with the last view."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_shard.transfer import mapping
from jupyter_shard.transfer.mapping import MappingError, mapped

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memory mappings are Linux-only here")

PAGE = mmap.PAGESIZE


class _RecordingLibc:
    """Passes every call to the real libc and records madvise and munmap."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def mmap(self, *args: Any) -> Any:
        return self.real.mmap(*args)

    def madvise(self, *args: Any) -> Any:
        self.calls.append(("madvise", args))
        return self.real.madvise(*args)

    def munmap(self, *args: Any) -> Any:
        self.calls.append(("munmap", args))
        return self.real.munmap(*args)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> _RecordingLibc:
    rec = _RecordingLibc(mapping.libc)
    monkeypatch.setattr(mapping, "libc", rec)
    return rec


def test_fresh_memory_is_writable_zeroed_bytes_of_the_size_asked() -> None:
    view = mapped(3 * PAGE + 5)
    assert view.nbytes == 3 * PAGE + 5 and view.format == "B" and not view.readonly
    assert bytes(view[:64]) == bytes(64) and view[-1] == 0
    view[0], view[-1] = 7, 9
    assert (view[0], view[-1]) == (7, 9)


def test_a_file_is_mapped_from_its_offset_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "segment"
    path.write_bytes(b"a" * PAGE + b"payload" + b"z" * (PAGE - 7))
    fd = os.open(path, os.O_RDONLY)
    try:
        view = mapped(PAGE, fd=fd, offset=PAGE)
    finally:
        os.close(fd)  # the mapping keeps no descriptor
    assert bytes(view[:7]) == b"payload" and bytes(view[7:9]) == b"zz"
    view[:7] = b"changed"  # private: this process sees it, the file does not change
    assert bytes(view[:7]) == b"changed"
    assert path.read_bytes()[PAGE : PAGE + 7] == b"payload"


def test_a_refused_mapping_raises_mapping_error_with_the_errno() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)  # a closed descriptor
    with pytest.raises(MappingError) as info:
        mapped(PAGE, fd=fd)
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.EBADF
    assert info.value.strerror == os.strerror(errno.EBADF)


def test_without_libc_a_mapping_is_refused_with_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapping, "libc", None)
    with pytest.raises(MappingError, match="need Linux"):
        mapped(PAGE)


def test_huge_asks_for_huge_pages_and_only_then(recording: _RecordingLibc) -> None:
    plain = mapped(4 * PAGE)
    assert [c for c, _ in recording.calls] == []
    huge = mapped(4 * PAGE, huge=True)
    (call,) = [args for name, args in recording.calls if name == "madvise"]
    assert call[1:] == (4 * PAGE, mmap.MADV_HUGEPAGE)
    assert plain.nbytes == huge.nbytes == 4 * PAGE


def test_the_region_is_unmapped_when_the_last_view_over_it_goes(recording: _RecordingLibc) -> None:
    view = mapped(2 * PAGE)
    part = view[PAGE:]
    del view
    gc.collect()
    assert not [c for c in recording.calls if c[0] == "munmap"], "a slice still holds the region"
    part[0] = 1
    del part
    gc.collect()
    ((name, (address, size)),) = recording.calls
    assert name == "munmap" and size == 2 * PAGE and address
