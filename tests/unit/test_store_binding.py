"""Where the agent's stores listen (agent/store_binding.py), on real sockets and stores."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_train.agent.store_binding import listening_store, loopback_address, node_store_host


def test_loopback_names_and_the_node_stores_host() -> None:
    assert loopback_address("127.0.0.1") == "127.0.0.1"
    assert loopback_address("localhost") == "127.0.0.1"
    assert loopback_address("[::1]") == "::1"
    assert loopback_address("10.0.0.7") is None and loopback_address("node-a") is None
    assert node_store_host(True, None) == "127.0.0.1"
    assert node_store_host(True, "10.0.0.7") == "127.0.0.1"  # one node: no remote client
    assert node_store_host(False, "10.0.0.7") == "10.0.0.7"
    assert node_store_host(False, "node-a.example") is None  # a name: every interface
    assert node_store_host(False, None) is None


def test_a_listening_store_serves_on_its_address_only() -> None:
    store = listening_store("127.0.0.1", 0, wait_for_workers=False,
                            timeout=timedelta(seconds=10))
    store.set("key", "value")
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    assert client.get("key") == b"value"
    probe = socket.socket()
    try:  # the same port is free on another address (a wildcard listener would hold it)
        probe.bind(("127.0.0.2", store.port))
    except OSError as exc:
        pytest.fail(f"the store listens beyond 127.0.0.1: {exc}")
    finally:
        probe.close()


def test_a_port_in_use_is_a_runtime_error_as_torchs_own() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(RuntimeError, match=r"cannot listen on 127\.0\.0\.1:\d+"):
            listening_store("127.0.0.1", taken.getsockname()[1], wait_for_workers=False,
                            timeout=timedelta(seconds=5))
    finally:
        taken.close()
