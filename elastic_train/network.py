"""Which network interface a job across hosts talks on, and the line when it cannot.

gloo (and NCCL's bootstrap) pick the address a worker advertises to its peers by
resolving the host's name, unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an
interface. On many hosts the name resolves to loopback (Debian's default ``127.0.1.1
HOSTNAME`` line in ``/etc/hosts``, many container images): the worker then advertises
127.0.x.x, and a job across hosts never forms its group. So for a job that may span nodes,
the launcher names the interface for the workers when the user did not: the one holding
``--local-addr``, else the one this host reaches the rendezvous endpoint by (the route the
kernel picks; an endpoint on this host itself: the interface holding that address). Where
that is a loopback interface while other hosts must reach this one, it refuses before any
worker starts (``NetworkConfigError``). Free of torch imports (the launcher runs it first).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_train.errors import NetworkConfigError

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915
_IF_INET6 = "/proc/net/if_inet6"


@dataclass(frozen=True)
class Interface:
    """A network interface of this host and the address on it that was asked about."""

    name: str
    address: str

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def resolve(host: str) -> str | None:
    """``host`` as an IP address (names through the resolver, as gloo does); None if it
    does not resolve."""
    host = host.strip("[]")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """Every IPv6 address of this host -> its interface (from /proc/net/if_inet6)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open(_IF_INET6) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                raw = fields[0]
                address = ipaddress.IPv6Address(int(raw, 16))
                found[str(address)] = fields[5]
    return found


def interface_holding(address: str) -> Interface | None:
    """The interface of this host that holds IP ``address`` (None: no interface does)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        name = _ipv6_interfaces().get(str(ip))
        return Interface(name, str(ip)) if name else None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return Interface(name, str(ip))
    return None


def source_address_towards(address: str) -> str | None:
    """The address this host sends from to reach IP ``address`` (the kernel's route; no
    packet is sent: a UDP socket's connect only picks the route). None: no route."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError:
            return None
        return str(s.getsockname()[0])


def worker_interface(local_addr: str | None, endpoint_host: str | None) -> Interface | None:
    """The interface the workers of a job across hosts should advertise: the one holding
    ``--local-addr``, else the one the rendezvous endpoint is reached by. None when neither
    tells (no --local-addr, no endpoint, or addresses that belong to no interface here).

    Raises ``NetworkConfigError`` when ``--local-addr`` does not resolve."""
    if local_addr:
        address = resolve(local_addr)
        if address is None:
            raise NetworkConfigError(
                f"--local-addr {local_addr} does not resolve to an address: pass this "
                "host's IP address on the network the other nodes share")
        found = interface_holding(address)
        if found is not None or ipaddress.ip_address(address).is_loopback:
            return found or Interface("lo", address)
        return None  # an address of a NAT or a proxy, not ours: leave the choice to gloo
    if not endpoint_host:
        return None
    target = resolve(endpoint_host)
    if target is None:
        return None  # the rendezvous' own check names an endpoint that does not resolve
    source = source_address_towards(target)
    return interface_holding(source) if source else None


def socket_ifname_defaults(multi_node: bool, local_addr: str | None,
                           endpoint_host: str | None, environ: Mapping[str, str]
                           ) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for the workers of a job that may
    span hosts (``multi_node``), for each the user did not set: the interface of
    ``worker_interface``. Empty for a job of one node, or when nothing tells.

    Raises ``NetworkConfigError`` when the workers would advertise a loopback address to
    other hosts: ``--local-addr`` names one while the rendezvous endpoint is elsewhere."""
    missing = [v for v in SOCKET_IFNAME_VARIABLES if not environ.get(v)]
    if not multi_node or not missing:
        return {}
    interface = worker_interface(local_addr, endpoint_host)
    if interface is None:
        return {}
    endpoint_ip = resolve(endpoint_host) if endpoint_host else None
    others_elsewhere = endpoint_ip is not None and not ipaddress.ip_address(
        endpoint_ip).is_loopback
    if interface.is_loopback and others_elsewhere:
        raise NetworkConfigError(
            f"--local-addr {local_addr} is the loopback address {interface.address}, which "
            f"other nodes cannot reach (the rendezvous is at {endpoint_host}): pass this "
            "host's IP address on the network the nodes share, or set GLOO_SOCKET_IFNAME "
            "(NCCL_SOCKET_IFNAME on GPUs) to its interface")
    return dict.fromkeys(missing, interface.name)


def advertised_loopback(error_text: str) -> str | None:
    """The loopback address a peer advertised, named in a gloo connect error
    (``remote=[127.0.1.1]:PORT``), else None."""
    marker = "remote=["
    start = error_text.find(marker)
    if start < 0:
        return None
    end = error_text.find("]", start)
    candidate = error_text[start + len(marker):end]
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(candidate).is_loopback:
            return candidate
    return None
