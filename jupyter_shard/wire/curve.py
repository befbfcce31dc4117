"""CurveZMQ for a pool whose ranks dial back over TCP: an encrypted channel open to one client key.

Each multi-node pool makes two fresh Curve key pairs: the server's (the kernel's ROUTER) and one client
pair that every rank of that pool uses. A ZAP handler in the kernel admits only that client key, so a
peer without it is refused during the handshake, before any frame reaches the pool; the HMAC on every
message (:mod:`jupyter_shard.wire.protocol`) still applies inside the channel. The client keys travel to
the ranks the way the HMAC key does: in the environment of the processes the launcher starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded keys of one pool."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def new(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support, which multi-node pools need")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def client_env(self) -> str:
        """What a rank needs, as one environment value (Z85 never contains a space)."""
        return b" ".join((self.server_public, self.client_public, self.client_secret)).decode()


class _OnlyOurClient:
    """ZAP credentials check: only the pool's own client key gets in; refusals are counted."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key == self.client_public
        if not allowed:
            self.refused += 1
        return allowed


HANDSHAKE_MS = 5000  # a rank's handshake takes milliseconds; anyone else's is closed after this


class CurveServer:
    """Makes a ROUTER a Curve server that admits only the pool's client key."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        self.keys = keys
        self._check = _OnlyOurClient(keys.client_public)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("jupyter_shard.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._check)

    @property
    def refused(self) -> int:
        """Handshakes refused for a client key that is not the pool's."""
        return self._check.refused

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Curve with the pool's keys; a connection that has not finished its handshake (so has not
        authenticated) within :data:`HANDSHAKE_MS` is closed, where ZeroMQ's default waits 30 s."""
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.curve_server = True
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)

    def stop(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket[bytes], value: str) -> None:
    """Set a rank's socket up as the pool's Curve client from :meth:`CurveKeys.client_env`."""
    server_public, client_public, client_secret = (part.encode() for part in value.split(" "))
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret
