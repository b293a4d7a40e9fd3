"""Where the agent's TCP stores listen: on loopback when every client is on this host.

torch's ``TCPStore`` server listens on every interface, whatever host it is given. An
agent of ``elastic-train run`` serves two: the c10d rendezvous store (on the node that
hosts it) and its own node store (live recovery: its workers, and the agents of other
nodes, call it). A one-node job, or a rendezvous endpoint on loopback, has no client on
another host, so those stores listen on loopback only (torch accepts a socket bound by
the caller: ``master_listen_fd``). A job across nodes keeps listening where its peers
reach it: on the ``--local-addr`` when that is an IP address, else on every interface.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def loopback_address(host: str) -> str | None:
    """The loopback IP address ``host`` names (``localhost`` included), else None."""
    if host == "localhost":
        return LOOPBACK
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return str(address) if address.is_loopback else None


def node_store_host(single_node: bool, local_addr: str | None) -> str | None:
    """Where an agent's node store listens (None: every interface): loopback for a job of
    one node, its ``--local-addr`` when that is an IP address."""
    if single_node:
        return LOOPBACK
    if local_addr:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(local_addr.strip("[]")))
    return None


def listening_store(host: str, port: int, **kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore`` server that listens on ``host`` (an IP address) only; ``port`` 0
    picks a free one. A port in use raises ``RuntimeError``, as torch's own does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True,
                              master_listen_fd=listener.fileno(), **kwargs)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store


@contextlib.contextmanager
def rendezvous_store_on_loopback() -> Iterator[None]:
    """While torch's c10d rendezvous backend makes its store: a server for an endpoint on
    loopback listens on loopback only."""
    from elastic_train.agent.torch_seams import rendezvous_store_replaced

    def make(original: Callable[..., dist.TCPStore]) -> Callable[..., dist.TCPStore]:
        def store(host: str, port: int, *args: Any, is_master: bool = False,
                  **kwargs: Any) -> dist.TCPStore:
            address = loopback_address(host)
            if is_master and address is not None and not args:
                return listening_store(address, port, **kwargs)
            return original(host, port, *args, is_master=is_master, **kwargs)

        return store

    with rendezvous_store_replaced(make):
        yield
