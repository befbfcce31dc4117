"""jupyter_shard.wire.curve: the pool's Curve keys, as the env value ranks get, and the check that lets only
the pool's client in.
"""

from __future__ import annotations

from types import SimpleNamespace

from jupyter_shard.wire import curve
from jupyter_shard.wire.curve import CurveKeys, _OnlyOurClient

Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def test_client_env_is_three_z85_keys() -> None:
    keys = CurveKeys.new()
    value = keys.client_env()
    parts = value.split(" ")
    assert parts == [k.decode() for k in (keys.server_public, keys.client_public, keys.client_secret)]
    assert all(len(p) == 40 and set(p) <= Z85 for p in parts)
    assert keys.server_secret.decode() not in value
    assert CurveKeys.new().client_env() != value, "every pool gets fresh keys"


def test_secure_client_takes_the_env_value_apart() -> None:
    keys = CurveKeys.new()
    sock = SimpleNamespace()
    curve.secure_client(sock, keys.client_env())  # type: ignore[arg-type]
    assert sock.curve_serverkey == keys.server_public
    assert sock.curve_publickey == keys.client_public
    assert sock.curve_secretkey == keys.client_secret


def test_only_the_pools_client_key_gets_in() -> None:
    keys, stranger = CurveKeys.new(), CurveKeys.new()
    check = _OnlyOurClient(keys.client_public)
    assert check.callback("*", keys.client_public) is True
    assert check.refused == 0
    assert check.callback("*", stranger.client_public) is False
    assert check.callback("*", keys.server_public) is False
    assert check.callback("", b"") is False
    assert check.refused == 3
    assert check.callback("*", keys.client_public) is True
    assert check.refused == 3
