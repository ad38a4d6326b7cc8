"""What both ends of a connection share: addresses, the bundle fingerprint, a locked socket, the handshake.

The head (client, head.py) and the stage worker (server, worker.py) import this module and never each
other. It knows frames and the Hello handshake, nothing about models.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from ovshard.bundle import names
from ovshard.bundle.manifest import sha256_file
from ovshard.errors import OvshardError
from ovshard.runtime import protocol as p
from ovshard.runtime.framing import read_message, write_message


def parse_address(text: str) -> tuple[str, int]:
    """(host, port) from "host:port"; port 0 asks the system for a free port when listening."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise OvshardError(f"address {text!r}: expected host:port, e.g. 127.0.0.1:7001")
    return host, int(port)


def bundle_fingerprint(bundle: Path) -> str:
    """What both ends of a connection must agree on: the manifest's sha256."""
    return "sha256:" + sha256_file(Path(bundle) / names.MANIFEST_FILE)


class Connection:
    """A socket with a write lock (several threads may send on it; one thread reads)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer, self.lock = sock, peer, threading.Lock()

    def send(self, msg: p.Message) -> None:
        with self.lock:
            write_message(self.sock, msg)

    def receive(self) -> p.Message:
        return read_message(self.sock)

    def close(self) -> None:
        self.sock.close()


def connect(address: str, stage: int, fingerprint: str, role: str, next_hop: str | None = None,
            timeout: float = 30.0) -> Connection:
    """Open a connection to a stage and complete the handshake; errors name the host:port and stage."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise OvshardError(f"cannot reach stage {stage} at {address}: {e.strerror or e}; is "
                           f"`ovshard serve BUNDLE --stage {stage}` running there?") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        write_message(sock, p.Hello(role, p.PROTOCOL_VERSION, fingerprint, stage, None, next_hop))
        reply = read_message(sock)
    except (OSError, p.ConnectionClosed, p.ProtocolError) as e:
        sock.close()
        raise OvshardError(f"stage {stage} at {address} closed the handshake: {e}") from e
    if isinstance(reply, p.Error):
        sock.close()
        raise OvshardError(f"stage {stage} at {address} refused: {reply.message}")
    if not isinstance(reply, p.HelloOk):
        sock.close()
        raise OvshardError(f"stage {stage} at {address} answered {type(reply).__name__} to Hello")
    sock.settimeout(None)
    return Connection(sock, address)
