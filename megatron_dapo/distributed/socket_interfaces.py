"""Which network interface gloo and NCCL should use between nodes: facts, the choice, the checks.

    python -m megatron_dapo.distributed.socket_interfaces node002     # prints e.g. "eth0"

Gloo binds to the address its host name resolves to unless GLOO_SOCKET_IFNAME names an interface.
Many clusters resolve a node's own name to 127.0.1.1 (Debian's /etc/hosts) or to an address of a
management network the other nodes cannot reach: every gloo group spanning nodes (Megatron's
gloo groups, the trainer's object gathers) then fails or hangs at the first collective. NCCL
chooses its own interface (InfiniBand first, never lo or docker*) unless NCCL_SOCKET_IFNAME says
otherwise. `slurm/common.sh` exports GLOO_SOCKET_IFNAME as the interface this node reaches the
other nodes of the job through; `megatron-dapo doctor` checks the choice on every node.

The choice is a pure function of the interfaces' addresses, the peers' addresses and the route
(`choose_interface`); the three facts come from the operating system (IPv4 only).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys
from typing import Callable, Iterable, Mapping, Optional, Sequence

__all__ = [
    "choose_interface",
    "interface_addresses",
    "interface_for_peers",
    "is_loopback",
    "nccl_interface_matches",
    "resolve_ipv4",
    "route_source",
]

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: [its IPv4 address]} of this host (interfaces without an IPv4 address: [])."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                found[name] = [socket.inet_ntoa(packed[20:24])]
            except OSError:  # no IPv4 address (down, or IPv6 only)
                found[name] = []
    return found


def resolve_ipv4(host: str) -> list[str]:
    """The IPv4 addresses `host` resolves to here (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def route_source(ip: str) -> Optional[str]:
    """The local address the kernel would send from to reach `ip` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((ip, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def choose_interface(
    interfaces: Mapping[str, Sequence[str]],
    peer_ips: Iterable[str],
    route: Callable[[str], Optional[str]],
) -> Optional[str]:
    """The interface to reach the peers through: the one holding a peer's address when it is this
    host's own, else the one the route to the first reachable peer leaves from. Loopback addresses
    say nothing about the network and are skipped; None when no peer gives an answer."""
    owner = {ip: name for name, ips in interfaces.items() for ip in ips}
    for ip in peer_ips:
        if is_loopback(ip):
            continue
        if ip in owner:
            return owner[ip]
        source = route(ip)
        if source is not None and not is_loopback(source) and source in owner:
            return owner[source]
    return None


def interface_for_peers(hosts: Sequence[str]) -> Optional[str]:
    """`choose_interface` with this host's facts, for peers given by name or address."""
    this = socket.gethostname()
    # This host's own name is a peer too, but only after the others: its address tells the
    # interface when the name resolves to a real address, and nothing when it resolves to 127.x.
    ordered = [h for h in hosts if h != this] + [h for h in hosts if h == this]
    ips = [ip for host in ordered for ip in resolve_ipv4(host)]
    return choose_interface(interface_addresses(), ips, route_source)


def nccl_interface_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=`spec` selects among `names`: comma-separated prefixes,
    "=" for exact names, "^" to exclude (NCCL's syntax)."""
    names = list(names)
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    patterns = [p for p in (body[1:] if exact else body).split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [name for name in names if hit(name) != exclude]


def main(argv: Optional[list[str]] = None) -> int:
    """Print the interface to reach HOST... through (exit 1, nothing printed, when none is found)."""
    hosts = sys.argv[1:] if argv is None else argv
    if not hosts:
        print("usage: python -m megatron_dapo.distributed.socket_interfaces HOST [HOST ...]", file=sys.stderr)
        return 2
    chosen = interface_for_peers(hosts)
    if chosen is None:
        return 1
    print(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
