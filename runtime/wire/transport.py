"""What both ends of a connection share: addresses, the bundle fingerprint, a locked socket, the handshake.

The head (client, head.py) and the stage worker (server, worker.py) import this module and never each
other. It knows frames, TLS and the Hello handshake, nothing about models.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import ssl
import threading
from collections.abc import Iterator

from ovshard.errors import OvshardError
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire import tls as security
from ovshard.runtime.wire.address import parse_address
from ovshard.runtime.wire.framing import DEFAULT_MAX_FRAME, read_message, write_message

HANDSHAKE_TIMEOUT_S = 10.0  # TCP connect, TLS handshake and Hello/HelloOk, each


class Connection:
    """A socket (plain or TLS) with a write lock: several threads may send on it; one thread reads.

    ``identity`` is the peer's (role, name) from its verified certificate, or None without TLS.

    ``close`` may come from any thread while another is inside ``send`` or ``receive``: it shuts the socket
    down at once (waking them) but the file descriptor is released by the last thread to leave the socket.
    Closing it under a blocked reader would free the descriptor's number for the next file or pipe this
    process opens, and the reader's TLS library would then write its alert record into that file (seen:
    21 bytes of TLS at the start of a subprocess's captured stdout).
    """

    def __init__(self, sock: socket.socket, peer: str, identity: tuple[str, str] | None = None) -> None:
        self.sock, self.peer, self.identity = sock, peer, identity
        self.welcome: p.HelloOk | None = None  # the stage's answer to our Hello, on a connection we opened
        self.lock = threading.Lock()
        self.closed = False
        self._state = threading.Lock()
        self._users = 0

    def send(self, msg: p.Message) -> None:
        with self.lock, self._using():
            write_message(self.sock, msg)

    def receive(self, max_frame_bytes: int = DEFAULT_MAX_FRAME, deadline_s: float | None = None,
                idle_s: float | None = None) -> p.Message:
        with self._using():
            return read_message(self.sock, max_frame_bytes, deadline_s=deadline_s, idle_s=idle_s)

    def close(self) -> None:
        """Close once; a thread blocked on this socket wakes with ConnectionClosed or OSError."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            release = self._users == 0
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        if release:
            self.sock.close()

    def secure(self, tls: ssl.SSLContext, timeout_s: float) -> None:
        """The server side of the TLS handshake, within ``timeout_s``; ``identity`` from the peer's certificate."""
        with self._using():
            self.sock.settimeout(timeout_s)
            self.sock = tls.wrap_socket(self.sock, server_side=True)
            self.identity = peer_identity(self.sock)

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        with self._state:
            if self.closed:
                raise OSError(errno.EBADF, f"the connection to {self.peer} was closed")  # as a closed socket says
            self._users += 1
        try:
            yield
        finally:
            with self._state:
                self._users -= 1
                release = self.closed and self._users == 0
            if release:
                self.sock.close()


def peer_identity(sock: socket.socket) -> tuple[str, str] | None:
    """(role, name) from a TLS peer's verified certificate (OU and CN of its subject); None without TLS."""
    return security.peer_identity(sock) if isinstance(sock, ssl.SSLSocket) else None


def connect(address: str, stage: int, fingerprint: str, role: str, session: str, next_hop: str | None = None,
            timeout: float = HANDSHAKE_TIMEOUT_S, tls: ssl.SSLContext | None = None,
            kv_blocks: int | None = None) -> Connection:
    """Open a connection to a stage and complete the handshake; errors name the host:port and stage. The
    stage's HelloOk stays on the connection (``welcome``): a paged stage's block size and the blocks granted
    for ``kv_blocks``.

    With ``tls`` the connection is TLS with the cluster's certificates, both ways (mutual authentication).
    """
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise StageUnreachable(f"cannot reach stage {stage} at {address}: {e.strerror or e}; is "
                               f"`ovshard serve BUNDLE --stage {stage}` running there?") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    identity = None
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_side=False)
            identity = peer_identity(sock)
        except (ConnectionError, TimeoutError, ssl.SSLEOFError) as e:  # the peer went away: restarting, say
            sock.close()
            raise StageUnreachable(f"stage {stage} at {address} closed the TLS handshake: {e}") from e
        except OSError as e:
            sock.close()
            raise OvshardError(f"stage {stage}: {security.handshake_error(e, address)}") from e
        if identity is not None and identity[0] != "stage":
            sock.close()
            raise OvshardError(f"{address} presents a {identity[0]!r} certificate ({identity[1]}), not a stage's")
    try:
        write_message(sock, p.Hello(role, p.PROTOCOL_VERSION, fingerprint, stage, session, next_hop,  # type: ignore[arg-type]
                                    kv_blocks))
        reply = read_message(sock, deadline_s=timeout, idle_s=timeout)
    except ssl.SSLError as e:  # TLS 1.3: a refused client certificate shows at the first read
        sock.close()
        raise OvshardError(f"stage {stage}: {security.handshake_error(e, address)}") from e
    except (OSError, p.ConnectionClosed, p.ProtocolError) as e:
        sock.close()
        hint = "" if tls is not None else "; if the stage runs with --credentials, pass --credentials here too"
        raise StageUnreachable(f"stage {stage} at {address} closed the handshake: {e}{hint}") from e
    if isinstance(reply, p.Error):
        sock.close()
        error = StageUnreachable if reply.code in p.RECOVERABLE_CODES else OvshardError
        raise error(f"stage {stage} at {address} refused: {reply.message}")
    if not isinstance(reply, p.HelloOk):
        sock.close()
        raise OvshardError(f"stage {stage} at {address} answered {type(reply).__name__} to Hello")
    sock.settimeout(None)
    conn = Connection(sock, address, identity)
    conn.welcome = reply
    return conn


class StageUnreachable(OvshardError):
    """A stage could not be reached or is going away: worth retrying (it may be restarting)."""
