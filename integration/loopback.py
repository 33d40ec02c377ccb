"""Loopback addresses: the single-node default every adapter binds (issue 9, Security R6).

NOTE [ Loopback by resolution ]: whether an address is loopback is decided on the IP addresses it
resolves to, never on its spelling: ``LOCALHOST``, ``localhost.``, ``ip6-localhost``,
``0:0:0:0:0:0:0:1``, ``127.1`` and ``::ffff:127.0.0.1`` are all loopback, and a host name is
loopback only if every address it resolves to is (a name that also resolves to a routable address
is a network address: its listeners can be reached from the network). ``localhost`` and names
under it (any case, with or without the trailing dot) are loopback without a lookup, as RFC 6761
requires of every resolver (glibc's files backend alone does not know ``localhost.``). A guard
that asks for an explicit opt-in before an engine opens listeners off loopback must use this, or
a differently spelled loopback name slips past it. A name that does not resolve is an error
naming it (``resolve``); ``is_loopback`` answers False for it.
"""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def resolve(address: str) -> tuple[str, ...]:
    """The IP addresses ``address`` (an IP literal or a host name, no port) stands for.

    ``ValueError`` naming the address if it is empty or does not resolve.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"address {address!r} is empty; give an IP address or a host name")
    host = address.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        pass
    name = host.lower().removesuffix(".")
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761, section 6.3
        return ("127.0.0.1", "::1")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(
            f"address {address!r} does not resolve ({exc}); give an IP address"
        ) from None
    return tuple(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or host name, no port) names only this host's loopback
    interface, decided on what it resolves to (see NOTE [ Loopback by resolution ])."""
    try:
        ips = resolve(address)
    except ValueError:
        return False
    return bool(ips) and all(_loopback_ip(ip) for ip in ips)


def _loopback_ip(ip: str) -> bool:
    parsed = ipaddress.ip_address(ip)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.is_loopback
    return parsed.is_loopback
