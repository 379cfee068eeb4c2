"""Which network interface gloo should bind on a multi-node launch: the one that reaches the master.

gloo binds the address the host name resolves to unless ``GLOO_SOCKET_IFNAME`` names interfaces,
and on many clusters (and in network namespaces) that address is 127.0.0.1: the peers then dial
their own loopback and the group never forms. The interface whose route reaches the rendezvous
host (``MASTER_ADDR``) is the one every other node can reach too, so::

    pick = pick_gloo_interface(env, backend="gloo")   # None: nothing to pick (see below)
    if pick is not None and pick.name is not None:
        environ["GLOO_SOCKET_IFNAME"] = pick.name        # init does this, for its own process

The route is found by connecting a UDP socket to the master (no packet is sent: ``connect`` on a
datagram socket only asks the kernel's routing table for the source address), and the source
address is mapped to an interface name with ``socket.if_nameindex()`` and the ``SIOCGIFADDR``
ioctl (IPv4) or ``/proc/net/if_inet6`` (IPv6). Both lookups are parameters, so tests can give
any answer without touching the host. This module decides; it never writes ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

try:  # POSIX only; elsewhere no IPv4 address is matched to an interface (nothing is picked)
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
    _fcntl_module: ModuleType | None = None
else:
    _fcntl_module = _fcntl

from distcompat.launch._env import LaunchEnv

__all__ = [
    "AddressLookup",
    "InterfacePick",
    "RouteLookup",
    "interface_with_address",
    "is_multi_node",
    "pick_gloo_interface",
    "route_source_address",
]

#: ``host -> local source address`` of the route that reaches ``host`` (None: no route).
RouteLookup = Callable[[str], "str | None"]
#: ``local address -> interface name`` that holds it (None: no interface holds it).
AddressLookup = Callable[[str], "str | None"]

_SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's (primary) IPv4 address
_IFREQ_SIZE = 40  # struct ifreq on Linux: 16-byte name + a 24-byte union (sockaddr first)
_DISCARD_PORT = 9  # any port works: connect() on a UDP socket sends nothing


@dataclass(frozen=True, slots=True, kw_only=True)
class InterfacePick:
    """The interface init would bind gloo to, or ``name=None`` and why none was found.

    Example:
        >>> InterfacePick(name="eth0", reason="eth0 holds 10.0.0.2").name
        'eth0'
    """

    name: str | None
    reason: str


def route_source_address(host: str) -> str | None:
    """Return this host's source address for traffic to ``host``; None when there is no route.

    Resolves ``host`` and connects a UDP socket to it, which sends no packet; the kernel picks the
    route and the socket's local address is that route's source.

    Example:
        >>> route_source_address("127.0.0.1")
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host, _DISCARD_PORT, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def _ipv4_of(name: str) -> str | None:
    if _fcntl_module is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(f"{_IFREQ_SIZE}s", name.encode()[:15])
        try:
            answer = _fcntl_module.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:  # EADDRNOTAVAIL: the interface has no IPv4 address
            return None
    return socket.inet_ntoa(answer[20:24])  # ifr_addr.sin_addr, after name (16) + family/port (4)


def _ipv6_holder(address: ipaddress.IPv6Address) -> str | None:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
        fields = line.split()
        if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == address:
            return fields[5]
    return None


def interface_with_address(address: str) -> str | None:
    """Return the name of this host's interface that holds ``address`` (None: none does).

    IPv4 compares each interface's primary address (``SIOCGIFADDR``); a secondary address
    (``ip addr add`` a second time) is not seen. IPv6 reads ``/proc/net/if_inet6``.

    Example:
        >>> interface_with_address("127.0.0.1")
        'lo'
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return _ipv6_holder(ip)
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def is_multi_node(env: LaunchEnv) -> bool:
    """Whether ``env`` spans more than one node (the case where gloo's interface matters).

    Example:
        >>> is_multi_node(LaunchEnv.from_environ({}))
        False
    """
    return env.num_nodes > 1 or env.world_size > env.local_world_size


def pick_gloo_interface(
    env: LaunchEnv,
    backend: str | None = None,
    *,
    route: RouteLookup = route_source_address,
    holder: AddressLookup = interface_with_address,
) -> InterfacePick | None:
    """Choose ``GLOO_SOCKET_IFNAME`` for a multi-node gloo launch that left it unset.

    None when there is nothing to choose: one node, a backend without gloo, or
    ``GLOO_SOCKET_IFNAME`` already set (the user's setting always wins). Otherwise the interface
    that holds the source address of the route to ``env.master_addr``, or ``name=None`` with the
    reason none fits (no master, no route, the route is loopback, no interface holds the address).
    ``route`` and ``holder`` are the two host lookups, replaceable in tests.

    Example:
        >>> env = LaunchEnv.from_environ({"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
        ...     "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "MASTER_ADDR": "10.77.0.1",
        ...     "MASTER_PORT": "29500"})
        >>> pick = pick_gloo_interface(env, "gloo", route=lambda host: "10.77.0.2",
        ...     holder=lambda address: "veth1")
        >>> pick.name
        'veth1'
    """
    if not is_multi_node(env) or env.gloo_socket_ifname is not None:
        return None
    if backend is not None and "gloo" not in backend:
        return None
    master = env.master_addr
    if not master:
        return InterfacePick(name=None, reason="no rendezvous host (MASTER_ADDR) to route to")
    source = route(master)
    if source is None:
        return InterfacePick(name=None, reason=f"no route from this host to MASTER_ADDR={master}")
    try:
        loopback = ipaddress.ip_address(source.split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return InterfacePick(
            name=None,
            reason=(
                f"MASTER_ADDR={master} is reached through loopback ({source}) on this host, so "
                "no interface here is one the other nodes can reach"
            ),
        )
    name = holder(source)
    if name is None:
        return InterfacePick(
            name=None,
            reason=f"no interface holds {source}, the source address of the route to {master}",
        )
    return InterfacePick(
        name=name,
        reason=(
            f"{name}: the interface whose route reaches MASTER_ADDR={master} "
            f"(source address {source})"
        ),
    )
