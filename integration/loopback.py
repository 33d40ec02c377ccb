"""Loopback addresses: the single-node default every adapter binds (issue 9, Security R6)."""

from __future__ import annotations

LOOPBACK = "127.0.0.1"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or host name, no port) names this host's loopback interface."""
    return address in ("localhost", "::1") or address.startswith(("127.", "::ffff:127."))
