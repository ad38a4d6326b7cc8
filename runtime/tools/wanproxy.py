"""A delaying TCP proxy that emulates a WAN link between pipeline stages (standard library only).

The kernel here has no netem, so tests and benchmarks put a :class:`DelayProxy` in front of a stage
worker (or any TCP server) to add one-way latency and, optionally, a bandwidth cap::

    with DelayProxy(target=("127.0.0.1", 7001), latency_s=0.025) as proxy:
        ...  # connect to proxy.address instead of 127.0.0.1:7001

Each client connection gets its own connection to the target; bytes flow both ways, "up" (client ->
target, ``latency_s``) and "down" (target -> client, ``latency_back_s``). Per direction, a chunk of n
bytes read at time t is released to the other side at

    release = max(t + latency, previous release) + n / bandwidth       (the last term is 0 without a cap)

which is a link with a fixed propagation delay that serialises bytes at the capped rate. Chunks wait
in a queue ordered by release time and a sender thread delivers each at its time, so back-to-back
messages keep their spacing instead of queueing behind each other's delay. Not modelled: loss,
jitter, and the round trip of the TCP handshake (the connection to the target opens at once).

A side that closes (or fails) ends its direction: the other side receives everything still queued,
then end of stream. The connection pair is released once both directions have ended, or at once when
a send fails. A tool, not the wire: nothing a head or a stage runs goes through it unless a user puts it there.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

Address = tuple[str, int]

CHUNK_BYTES = 64 * 1024  # one recv
# bytes queued per direction before the reader stops reading: the emulated link's window, so a
# bandwidth-capped transfer pushes back on its sender instead of filling the proxy's memory
MAX_QUEUED_BYTES = 64 * 1024 * 1024
CONNECT_TIMEOUT_S = 10.0


class _Link:
    """One direction of one connection: ``read_loop`` queues chunks by release time, ``send_loop`` delivers."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, latency_s: float,
                 bandwidth: float | None, direction: str) -> None:
        self.conn, self.src, self.dst = conn, src, dst
        self.latency_s, self.bandwidth, self.direction = latency_s, bandwidth, direction
        self.queue: deque[tuple[float, bytes | None]] = deque()  # (release time, chunk); None = end of stream
        self.queued_bytes = 0
        self.last_release = 0.0
        self.stopped = False
        self.cond = threading.Condition()

    def read_loop(self) -> None:
        try:
            while self._wait_for_room():
                data = self.src.recv(CHUNK_BYTES)
                if not data:
                    break
                self._put(data)
        except OSError:
            pass  # a reset or our own shutdown: end this direction like an orderly close
        finally:
            self._put(None)
            self.conn.thread_done()

    def send_loop(self) -> None:
        try:
            while (data := self._next_due()) is not None:
                try:
                    self.dst.sendall(data)
                except OSError:
                    self.conn.abort()  # the receiver is gone: nothing more can be delivered either way
                    return
                self.conn.proxy._count(self.direction, len(data))
            if not self.stopped:
                self.conn.end_of_stream(self.dst)
        finally:
            self.conn.thread_done()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _wait_for_room(self) -> bool:
        with self.cond:
            while self.queued_bytes >= MAX_QUEUED_BYTES and not self.stopped:
                self.cond.wait()
            return not self.stopped

    def _put(self, data: bytes | None) -> None:
        now = time.monotonic()
        with self.cond:
            serialise = len(data) / self.bandwidth if data and self.bandwidth else 0.0
            self.last_release = max(now + self.latency_s, self.last_release) + serialise
            self.queue.append((self.last_release, data))
            self.queued_bytes += len(data) if data else 0
            self.cond.notify_all()

    def _next_due(self) -> bytes | None:
        """The next chunk once its release time has come; None at end of stream or when stopped."""
        with self.cond:
            while not self.stopped:
                if self.queue:
                    wait = self.queue[0][0] - time.monotonic()
                    if wait <= 0:
                        _, data = self.queue.popleft()
                        self.queued_bytes -= len(data) if data else 0
                        self.cond.notify_all()
                        return data
                    self.cond.wait(wait)
                else:
                    self.cond.wait()
            return None


class _Connection:
    """A client socket, its upstream socket, and the two links between them (four threads)."""

    def __init__(self, proxy: DelayProxy, client: socket.socket, upstream: socket.socket, peer: str) -> None:
        self.proxy, self.client, self.upstream, self.peer = proxy, client, upstream, peer
        self.links = (
            _Link(self, client, upstream, proxy.latency_s, proxy.bandwidth_bytes_per_s, "up"),
            _Link(self, upstream, client, proxy.latency_back_s, proxy.bandwidth_bytes_per_s, "down"),
        )
        self.lock = threading.Lock()
        self.ended = 0  # directions whose end of stream has been delivered
        self.running = 0  # threads still running; the last one closes the sockets

    def start(self) -> None:
        threads = [threading.Thread(target=fn, name=f"wanproxy {self.peer} {link.direction} {fn.__name__}",
                                    daemon=True)
                   for link in self.links for fn in (link.read_loop, link.send_loop)]
        self.running = len(threads)
        for t in threads:
            t.start()

    def end_of_stream(self, dst: socket.socket) -> None:
        """A sender delivered everything its side will ever send: pass the close on."""
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self.lock:
            self.ended += 1
            both = self.ended == len(self.links)
        if both:
            self.abort()  # nothing left to relay: release the readers and senders

    def abort(self) -> None:
        """Stop both directions now; queued data is dropped. Sockets close when the last thread ends."""
        for link in self.links:
            link.stop()
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv
            except OSError:
                pass

    def thread_done(self) -> None:
        with self.lock:
            self.running -= 1
            last = self.running == 0
        if last:
            self.client.close()
            self.upstream.close()
            self.proxy._forget(self)


class DelayProxy:
    """Relay TCP connections from ``listen`` to ``target`` with one-way latency and an optional bandwidth cap.

    ``latency_back_s`` (target -> client) defaults to ``latency_s`` (client -> target); the bandwidth
    cap, in bytes per second, applies to each direction separately. ``start()`` returns once it is
    listening; ``address`` is then ``"host:port"`` (``listen`` may use port 0). ``bytes_up`` and
    ``bytes_down`` count the bytes delivered so far over all connections.
    """

    def __init__(self, listen: Address = ("127.0.0.1", 0), target: Address | None = None,
                 latency_s: float = 0.0, latency_back_s: float | None = None,
                 bandwidth_bytes_per_s: float | None = None) -> None:
        if target is None:
            raise ValueError("DelayProxy needs target=(host, port), the server to relay to")
        latency_back_s = latency_s if latency_back_s is None else latency_back_s
        if latency_s < 0 or latency_back_s < 0:
            raise ValueError(f"latencies must be >= 0 seconds, found {latency_s} and {latency_back_s}")
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s (or None for no cap), found {bandwidth_bytes_per_s}")
        self.listen, self.target = listen, target
        self.latency_s, self.latency_back_s = latency_s, latency_back_s
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as connections close
        self._counts = {"up": 0, "down": 0}
        self._connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = False

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("the proxy is not listening; call start() first")
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def bytes_up(self) -> int:
        with self._lock:
            return self._counts["up"]

    @property
    def bytes_down(self) -> int:
        with self._lock:
            return self._counts["down"]

    def start(self) -> DelayProxy:
        family = socket.AF_INET6 if ":" in self.listen[0] else socket.AF_INET
        listener = socket.create_server(self.listen, family=family, backlog=128)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, name="wanproxy accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, drop every connection (queued data is not delivered) and wait for them to close."""
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
            except OSError:
                pass
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        for conn in connections:
            conn.abort()
        with self._idle:
            self._idle.wait_for(lambda: not self._connections, timeout=5)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, peer = self._listener.accept()
            except OSError:
                return  # stop() shut the listener
            threading.Thread(target=self._open, args=(client, f"{peer[0]}:{peer[1]}"),
                             name="wanproxy connect", daemon=True).start()

    def _open(self, client: socket.socket, peer: str) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            logger.warning("%s: cannot reach %s:%d (%s); closing the client", peer, *self.target, e)
            client.close()
            return
        try:
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:  # the client left while we connected
            logger.info("%s: gone before the relay started (%s)", peer, e)
            client.close()
            upstream.close()
            return
        conn = _Connection(self, client, upstream, peer)
        with self._lock:
            if self._stopping:
                client.close()
                upstream.close()
                return
            self._connections.add(conn)
        logger.info("%s: connected to %s:%d", peer, *self.target)
        conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._idle:
            self._connections.discard(conn)
            self._idle.notify_all()
        logger.info("%s: closed", conn.peer)

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            self._counts[direction] += n


