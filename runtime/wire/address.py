"""Addresses as the command line and the stages write them: ``host:port``. Standard library only (the WAN
proxy imports it without the rest of the runtime)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from ovshard.errors import OvshardError


def parse_address(text: str, option: str = "address") -> tuple[str, int]:
    """(host, port) from "host:port" (IPv6 hosts in brackets); port 0 asks the system for a free port when
    listening. Errors name ``option``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise OvshardError(f"{option} {text!r}: expected host:port with a port from 0 to 65535, "
                           "e.g. 127.0.0.1:7000")
    return host.strip("[]"), int(port)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # free_port's candidates start here: above the ports services are configured on


def free_port() -> int:
    """A port nothing listens on now, chosen below the system's ephemeral range (the ports the system hands a
    process that binds port 0, as Ray's workers and agents do, so none of them takes it before its listener
    binds it). Still racy with a process that binds this very port: a listener that can, binds port 0 instead.
    Falls back to an ephemeral port where no candidate is free."""
    low, rng = ephemeral_low(), random.Random()
    candidates = [rng.randrange(LOWEST, low) for _ in range(64)] if low > LOWEST else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OvshardError("no free port: not even the system would hand one out (port 0)")


def ephemeral_low() -> int:
    """The first port of the system's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
