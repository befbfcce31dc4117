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


def test_a_connection_that_does_not_authenticate_is_closed_within_the_handshake_limit() -> None:
    """A raw TCP client that sends nothing: the kernel's Curve socket closes it after HANDSHAKE_MS
    (ZeroMQ's default would hold it 30 s), and the socket answers its own rank meanwhile."""
    import socket
    import time

    import zmq

    ctx = zmq.Context()
    server = curve.CurveServer(ctx, CurveKeys.new())
    sock = ctx.socket(zmq.ROUTER)
    try:
        server.secure(sock)
        assert sock.getsockopt(zmq.HANDSHAKE_IVL) == curve.HANDSHAKE_MS
        sock.setsockopt(zmq.HANDSHAKE_IVL, 300)  # the same limit, shortened for the test
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        silent = socket.create_connection(("127.0.0.1", port))
        silent.settimeout(5.0)
        began = time.monotonic()
        try:
            while silent.recv(4096):  # ZMTP's greeting, then nothing: the server closes it
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - began < 4.0
        silent.close()
    finally:
        sock.close(linger=0)
        server.stop()
        ctx.term()
