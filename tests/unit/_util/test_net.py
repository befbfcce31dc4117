"""jupyter_shard._util.net: a free loopback port, and the loopback interface's name."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from jupyter_shard._util import net
from jupyter_shard._util.net import free_port, loopback_interface


def test_free_port_is_a_port_that_can_be_bound_on_loopback() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # free: the probing socket was closed


def _addr(family: int, address: str) -> SimpleNamespace:
    return SimpleNamespace(family=family, address=address)


def test_loopback_interface_is_the_one_carrying_127(monkeypatch: pytest.MonkeyPatch) -> None:
    interfaces = {
        "eth0": [_addr(socket.AF_INET, "10.0.0.5")],
        "lo6": [_addr(socket.AF_INET6, "::1")],
        "lo0": [_addr(socket.AF_INET6, "fe80::1"), _addr(socket.AF_INET, "127.0.0.1")],
    }
    monkeypatch.setattr(net.psutil, "net_if_addrs", lambda: interfaces)
    assert loopback_interface() == "lo0"


def test_loopback_interface_falls_back_to_lo(monkeypatch: pytest.MonkeyPatch) -> None:
    interfaces = {"eth0": [_addr(socket.AF_INET, "192.168.1.2")], "v6": [_addr(socket.AF_INET6, "::1")]}
    monkeypatch.setattr(net.psutil, "net_if_addrs", lambda: interfaces)
    assert loopback_interface() == "lo"


def test_loopback_interface_on_this_machine_carries_127() -> None:
    import psutil

    name = loopback_interface()
    addrs = psutil.net_if_addrs().get(name, [])
    assert name == "lo" or any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs)
