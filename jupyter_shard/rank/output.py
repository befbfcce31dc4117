"""Rank output: stdout/stderr and rich display go to the log on disk at once and to the kernel in
coalesced chunks (at most one message per stream per flush interval, whatever the print rate)."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any, Literal

from jupyter_shard.wire.messages import STREAM
from jupyter_shard.wire.protocol import TEXT_ERRORS

MAX_PENDING = 256 * 1024

Sender = Callable[[str, Mapping[str, Any], list[bytes]], None]


class RankStream(io.TextIOBase):
    """A ``sys.stdout``/``sys.stderr`` replacement that tees to the rank log and the kernel."""

    def __init__(
        self,
        name: Literal["stdout", "stderr"],
        log: IO[str],
        enqueue: Sender,
        cell_id: Callable[[], str],
        lock: threading.Lock,
    ) -> None:
        super().__init__()
        self.name = name
        self._name = name  # ``name`` as the stream body's type (``TextIOBase.name`` is any)
        self._log = log
        self._enqueue = enqueue
        self._cell_id = cell_id
        self._pending: list[str] = []
        self._size = 0
        self._lock = lock  # shared by both streams: they write one log file

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._log.fileno()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        with self._lock:
            self._log.write(text)
            self._pending.append(text)
            self._size += len(text)
            if self._size >= MAX_PENDING:
                self._flush_locked()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._log.flush()
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self._size = 0
        data = text.encode("utf-8", TEXT_ERRORS)
        self._enqueue(*STREAM({"cell_id": self._cell_id(), "name": self._name}), [data])
