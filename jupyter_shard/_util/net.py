"""Loopback networking facts shared by the kernel, the launchers and exported scripts."""

from __future__ import annotations

import socket

import psutil


def free_port() -> int:
    """A currently free loopback port (for MASTER_PORT; the pool itself listens on no TCP port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def loopback_interface() -> str:
    """The name of the interface that carries 127.0.0.1 (``lo`` on Linux)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"
