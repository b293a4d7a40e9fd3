"""network.py: which interface the workers of a job across hosts advertise (this host's real
interfaces: loopback is on every machine; the other hosts' cases run across network
namespaces in tests/integration/test_across_hosts.py)."""

from __future__ import annotations

import pytest

from elastic_train.errors import NetworkConfigError
from elastic_train.network import (
    advertised_loopback,
    interface_holding,
    socket_ifname_defaults,
    worker_interface,
)


def test_the_interface_holding_an_address_is_found():
    found = interface_holding("127.0.0.1")
    assert found is not None and found.name == "lo" and found.is_loopback
    assert interface_holding("198.18.255.254") is None  # RFC 2544: on no interface here


def test_the_endpoint_route_names_the_interface_without_a_local_addr():
    assert worker_interface(None, "127.0.0.1") == interface_holding("127.0.0.1")
    assert worker_interface(None, "localhost").name == "lo"
    assert worker_interface(None, None) is None


def test_a_job_of_one_node_or_a_user_choice_is_left_alone():
    assert socket_ifname_defaults(False, None, "127.0.0.1", {}) == {}
    chosen = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib0"}
    assert socket_ifname_defaults(True, None, "127.0.0.1", chosen) == {}
    assert socket_ifname_defaults(True, None, "127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"}) \
        == {"NCCL_SOCKET_IFNAME": "lo"}


def test_every_agent_on_this_host_talks_on_loopback():
    assert socket_ifname_defaults(True, None, "127.0.0.1", {}) == {
        "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_a_loopback_local_addr_with_the_rendezvous_elsewhere_is_refused():
    with pytest.raises(NetworkConfigError) as refused:
        socket_ifname_defaults(True, "127.0.1.1", "198.18.0.1", {})
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("--local-addr 127.0.1.1 is the loopback address 127.0.1.1, which "
                           "other nodes cannot reach (the rendezvous is at 198.18.0.1)")
    assert "GLOO_SOCKET_IFNAME" in line


def test_a_local_addr_that_does_not_resolve_is_refused():
    with pytest.raises(NetworkConfigError, match="does not resolve"):
        worker_interface("no-such-host.invalid", None)


def test_an_address_of_no_interface_here_leaves_the_choice_to_gloo():
    assert worker_interface("198.18.255.254", None) is None  # behind a NAT, say


def test_a_peer_advertising_loopback_is_recognised_in_gloos_error():
    error = ("Gloo connectFullMesh failed with [../pair.cc:152] timed out connecting: "
             "SO_ERROR: Connection refused, remote=[127.0.1.1]:10126$0")
    assert advertised_loopback(error) == "127.0.1.1"
    assert advertised_loopback("remote=[198.18.0.3]:10126") is None
    assert advertised_loopback("Connection reset by peer") is None
