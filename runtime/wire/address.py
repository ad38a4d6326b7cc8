"""Addresses as the command line and the stages write them: ``host:port``. Standard library only (the WAN
proxy imports it without the rest of the runtime)."""

from __future__ import annotations

import socket

from ovshard.errors import OvshardError


def parse_address(text: str, option: str = "address") -> tuple[str, int]:
    """(host, port) from "host:port" (IPv6 hosts in brackets); port 0 asks the system for a free port when
    listening. Errors name ``option``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise OvshardError(f"{option} {text!r}: expected host:port with a port from 0 to 65535, "
                           "e.g. 127.0.0.1:7000")
    return host.strip("[]"), int(port)


def free_port() -> int:
    """A loopback port nothing listened on a moment ago. Racy by nature (another process may take it): a
    listener that can, binds port 0 instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
