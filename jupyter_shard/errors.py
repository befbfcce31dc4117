"""Every error jupyter_shard raises on purpose derives from :class:`ShardError`; :func:`one_line` quotes
an exception of the user's code inside such a message.

``except jupyter_shard.ShardError`` catches them all; each subclass also derives from the built-in
exception its callers would expect (a bad option is a ``ValueError``, a pool that cannot act a
``RuntimeError``), so code written against those keeps working. Messages are one line that says what
is wrong and what to do. :class:`~jupyter_shard.pool.results.DistributedError` (a cell failed on a
rank) lives beside the results it carries and derives from :class:`ShardError` too.
"""

from __future__ import annotations

__all__ = ["PoolError", "ProtocolError", "ShardError", "SpecError"]


class ShardError(Exception):
    """The base of every error jupyter_shard raises on purpose."""


class SpecError(ShardError, ValueError):
    """A bad option: the message is one line saying what is wrong and what is allowed."""


class PoolError(ShardError, RuntimeError):
    """The pool cannot do what was asked (not started, a rank is dead, start-up failed)."""


class ProtocolError(ShardError):
    """A frame that failed a size, signature, replay or schema check. Never fatal to the pool."""


def one_line(exc: BaseException) -> str:
    """``TypeError: what it said``, on one line and at most 160 characters of text: an exception of the
    user's code, quoted inside one of these messages."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
