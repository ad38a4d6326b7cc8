"""Helpers for tests of the runtime; the library and the CLI never import this module."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listened on a moment ago: for an address where no stage runs.

    Racy by nature (another process may take it); a worker that must listen uses ``--listen HOST:0``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
