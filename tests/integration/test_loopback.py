"""Loopback is decided on resolved addresses, not on spelling (issue 22, item 9)."""

from __future__ import annotations

import socket

import pytest

from knitkit.integration.loopback import is_loopback, resolve

SPELLINGS = (
    "127.0.0.1",
    "127.0.0.53",
    "127.1",
    "localhost",
    "LOCALHOST",
    "localhost.",
    "LocalHost.",
    "ip6-localhost",
    "::1",
    "0:0:0:0:0:0:0:1",
    "[::1]",
    "::ffff:127.0.0.1",
)
"""Ways to write this host's loopback interface."""


def in_hosts_file(name: str) -> bool:
    """Whether this host's resolver knows ``name`` (``ip6-localhost`` lives in /etc/hosts only
    where the distribution put it there)."""
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror:
        return False
    return True


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_of_loopback_is_loopback(spelling: str) -> None:
    """However loopback is spelled (case, trailing dot, IPv6 long form, IPv4-mapped, short
    IPv4), it is loopback; a guard that asks for an opt-in before listening off loopback sees it."""
    if spelling == "ip6-localhost" and not in_hosts_file(spelling):
        pytest.skip("ip6-localhost is not in this host's /etc/hosts, so nothing resolves it")
    assert is_loopback(spelling)
    assert resolve(spelling)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "8.8.8.8", "10.1.2.3", "::ffff:10.0.0.1"])
def test_wildcard_and_network_addresses_are_not_loopback(address: str) -> None:
    assert not is_loopback(address)


def test_a_name_that_does_not_resolve_is_named() -> None:
    """An unresolvable name is not loopback, and ``resolve`` names it in a ``ValueError``."""
    name = "no-such-host.invalid"
    assert not is_loopback(name)
    with pytest.raises(ValueError, match=r"no-such-host\.invalid"):
        resolve(name)
    with pytest.raises(ValueError, match="empty"):
        resolve(" ")
