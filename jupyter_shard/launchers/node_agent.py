"""The node agent of a torchrun or SLURM pool: ``torch.distributed.run``, with node 0's store bound to
the head address alone.

torch's static rendezvous makes node 0 host a TCPStore that listens on every interface of the node
(torch gives no way to choose one). Before handing over to ``torch.distributed.run``, node 0 here
opens that store itself on a socket bound to the address the other nodes were told (``--master-addr``),
as a multi-tenant store: the rendezvous then finds it by its port and uses it instead of opening
another. Should a later torch stop sharing it, the rendezvous's own store fails to bind the port this
one holds, and the agent ends with that error instead of listening everywhere.

The other nodes, and node 0 when the head address is one no other node could reach it by (a name this
machine resolves to loopback while the others resolve it elsewhere), run ``torch.distributed.run`` as
it is, the latter with a line in the agent's log saying why.

Run as ``python -m jupyter_shard.launchers.node_agent <torch.distributed.run options> -m module``.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

__all__ = ["bind_address", "main", "torchrun_options"]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def bind_address(head: str, nodes: int) -> tuple[int, str] | None:
    """``(family, address)`` for node 0's store to listen on, or None to leave it to torch.

    ``head`` as the other nodes were told it, resolved here. A name that resolves to loopback here
    (Debian's ``127.0.1.1 hostname``) is reached elsewhere by another address: with other nodes, no
    single address here is known to be it, and torch listens on all of them."""
    try:
        infos = socket.getaddrinfo(head, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    if not infos:
        return None
    family, _, _, _, sockaddr = infos[0]
    address = str(sockaddr[0])
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and nodes > 1 and head not in LOOPBACK_NAMES:
        return None
    return family, address


def torchrun_options(argv: Sequence[str]) -> Any:
    """``argv`` as ``torch.distributed.run`` reads it (its own parser: its options, not the script's)."""
    from torch.distributed.run import parse_args

    return parse_args(list(argv))


def _host_store(options: Any) -> Any:
    """Node 0's store, listening on the head address alone; None where it is left to torch."""
    from torch._C._distributed_c10d import TCPStore

    head, port = options.master_addr, options.master_port
    nodes = int(str(options.nnodes).split(":")[-1])
    if head is None or port is None:
        return None
    where = bind_address(head, nodes)
    if where is None:
        print(
            f"jupyter_shard: {head} resolves to loopback here but other nodes reach it otherwise; "
            "the rendezvous store listens on every interface of this node",
            file=sys.stderr,
            flush=True,
        )
        return None
    family, address = where
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, int(port)))
    listener.listen(1024)
    store = TCPStore(
        head,
        int(port),
        nodes,
        True,
        timedelta(seconds=600),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )
    return store


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    options = torchrun_options(args)
    store = _host_store(options) if options.rdzv_backend == "static" and options.node_rank == 0 else None
    from torch.distributed.run import main as run

    try:
        run(args)
    finally:
        del store


if __name__ == "__main__":
    main()
