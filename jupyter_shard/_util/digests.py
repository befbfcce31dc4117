"""SHA-256 of what a suspend holds, and the check a rank makes before it loads a part.

Why it exists: the kernel signs a suspend's manifest (:mod:`jupyter_shard.pool.suspend_seal`), which
lists each file's digest; the ranks write and load the files, so they hash what they wrote and check
what they are about to load against the manifest, in the same bytes they then load.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

CHUNK = 8 << 20


def digest_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    found = digest_file_until(path, None)
    assert found is not None  # (nothing to stop it)
    return found


def digest_file_until(path: Path, stop: threading.Event | None) -> str | None:
    """SHA-256 of a file's bytes, read in chunks; None if ``stop`` is set before the end."""
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(CHUNK):
            if stop is not None and stop.is_set():
                return None
            sha.update(chunk)
    return sha.hexdigest()


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(data: bytes, name: str, digests: dict[str, str]) -> None:
    """Refuse ``data`` read from ``name`` unless its SHA-256 is the one the signed manifest holds."""
    if digests.get(name) != digest_bytes(data):
        raise RuntimeError(
            f"{name} of this suspend does not match its signed manifest (changed after the suspend); "
            "nothing was loaded from it"
        )


def check_file(path: Path, name: str, digests: dict[str, str]) -> None:
    if digests.get(name) != digest_file(path):
        raise RuntimeError(
            f"{name} of this suspend does not match its signed manifest (changed after the suspend); "
            "nothing was loaded from it"
        )
