"""jupyter_shard.errors: one base for every error raised on purpose, each also the built-in its
callers expect."""

from __future__ import annotations

import pytest

import jupyter_shard
from jupyter_shard import errors
from jupyter_shard.errors import PoolError, ProtocolError, ShardError, SpecError


@pytest.mark.parametrize("cls", [SpecError, PoolError, ProtocolError])
def test_except_shard_error_catches_every_subclass(cls: type[ShardError]) -> None:
    with pytest.raises(ShardError, match=r"^what is wrong; what to do$"):
        raise cls("what is wrong; what to do")


def test_a_bad_option_is_a_value_error_and_a_pool_failure_a_runtime_error() -> None:
    with pytest.raises(ValueError):
        raise SpecError("--nproc must be at least 1")
    with pytest.raises(RuntimeError):
        raise PoolError("no pool")
    assert not issubclass(SpecError, RuntimeError)
    assert not issubclass(PoolError, ValueError)


def test_a_protocol_error_is_no_value_or_runtime_error() -> None:
    """A frame that fails a check must not be swallowed by code catching ValueError or RuntimeError."""
    assert issubclass(ProtocolError, Exception)
    assert not issubclass(ProtocolError, (ValueError, RuntimeError))
    assert not issubclass(ShardError, (ValueError, RuntimeError))


def test_the_public_names_are_the_same_classes_everywhere() -> None:
    from jupyter_shard.pool.results import DistributedError
    from jupyter_shard.wire import protocol

    assert sorted(errors.__all__) == ["PoolError", "ProtocolError", "ShardError", "SpecError"]
    assert jupyter_shard.ShardError is ShardError
    assert jupyter_shard.SpecError is SpecError
    assert jupyter_shard.PoolError is PoolError
    assert protocol.ProtocolError is ProtocolError
    assert issubclass(DistributedError, ShardError)
