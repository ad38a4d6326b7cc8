"""The WAN-emulating DelayProxy over real loopback sockets: latency, queueing, bandwidth, integrity, close, CLI.

Wall-clock assertions are lower bounds (the proxy must add at least its delay); upper bounds are only
generous sanity limits, since timings on shared machines drift widely.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import REPO

from ovshard.runtime.tools.wanproxy import DelayProxy

ROOT = REPO
TIMEOUT_S = 10.0


class Server:
    """A loopback TCP server running ``handler(conn)`` on a thread per connection."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(TIMEOUT_S)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self.handler(conn)

    def close(self) -> None:
        self.sock.close()


def echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)


@pytest.fixture
def echo_server() -> Iterator[Server]:
    server = Server(echo)
    yield server
    server.close()


def connect(proxy: DelayProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_round_trip_takes_both_one_way_latencies(echo_server: Server) -> None:
    """With 50 ms each way, an echo round trip through the proxy takes at least 100 ms."""
    with DelayProxy(target=("127.0.0.1", echo_server.port), latency_s=0.05) as proxy, connect(proxy) as sock:
        start = time.monotonic()
        sock.sendall(b"ping")
        assert recv_exactly(sock, 4) == b"ping"
        elapsed = time.monotonic() - start
    assert 0.1 <= elapsed < 5, elapsed


def test_back_to_back_messages_are_not_serialised_behind_each_others_delay(echo_server: Server) -> None:
    """Ten messages sent 5 ms apart with 100 ms each way all arrive in order, spread by ~50 ms, not ~1 s."""
    messages = [f"message {i:02d};".encode() for i in range(10)]
    expected = b"".join(messages)
    arrivals: list[tuple[float, bytes]] = []
    with DelayProxy(target=("127.0.0.1", echo_server.port), latency_s=0.1) as proxy, connect(proxy) as sock:
        start = time.monotonic()
        for m in messages:
            sock.sendall(m)
            time.sleep(0.005)  # separate reads at the proxy, so a serialising proxy would show it
        received = b""
        while len(received) < len(expected):
            chunk = sock.recv(65536)
            assert chunk
            arrivals.append((time.monotonic(), chunk))
            received += chunk
    assert received == expected
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first - start >= 0.2  # every byte still pays both one-way latencies
    assert last - first < 0.5, f"spread {last - first:.3f} s: chunks waited behind each other's delay"


def test_bandwidth_cap_serialises_bytes() -> None:
    """1 MB through a 10 MB/s cap takes at least ~0.1 s to reach the target."""
    payload = os.urandom(1_000_000)
    done = threading.Event()
    received = bytearray()

    def sink(conn: socket.socket) -> None:
        while len(received) < len(payload) and (chunk := conn.recv(65536)):
            received.extend(chunk)
        done.set()

    server = Server(sink)
    try:
        with DelayProxy(target=("127.0.0.1", server.port), bandwidth_bytes_per_s=10e6) as proxy, \
                connect(proxy) as sock:
            start = time.monotonic()
            sock.sendall(payload)
            assert done.wait(TIMEOUT_S)
            elapsed = time.monotonic() - start
    finally:
        server.close()
    assert bytes(received) == payload
    assert 0.09 <= elapsed < 5, elapsed


def test_large_round_trip_is_intact_and_counted(echo_server: Server) -> None:
    """A random 2 MB blob echoes back byte for byte, and both directions count 2 MB."""
    blob = os.urandom(2 * 1024 * 1024)
    with DelayProxy(target=("127.0.0.1", echo_server.port), latency_s=0.01) as proxy, connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(blob,))
        sender.start()
        echoed = recv_exactly(sock, len(blob))
        sender.join()
        deadline = time.monotonic() + TIMEOUT_S  # the down count lands just after the last send returns
        while proxy.bytes_down < len(blob) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (proxy.bytes_up, proxy.bytes_down) == (len(blob), len(blob))
    assert echoed == blob


def test_client_close_reaches_target_after_pending_data() -> None:
    """A client that sends and closes at once: the target gets all the data, then end of stream."""
    got: list[bytes] = []
    closed = threading.Event()

    def reader(conn: socket.socket) -> None:
        while chunk := conn.recv(65536):
            got.append(chunk)
        closed.set()

    server = Server(reader)
    try:
        with DelayProxy(target=("127.0.0.1", server.port), latency_s=0.05) as proxy:
            sock = connect(proxy)
            sock.sendall(b"last words")
            sock.close()
            assert closed.wait(TIMEOUT_S), "the upstream connection never saw end of stream"
    finally:
        server.close()
    assert b"".join(got) == b"last words"


def test_target_close_reaches_client_after_pending_data() -> None:
    """A target that sends and closes at once: the client gets all the data, then end of stream."""

    def greeter(conn: socket.socket) -> None:
        conn.sendall(b"hello and goodbye")

    server = Server(greeter)
    try:
        with DelayProxy(target=("127.0.0.1", server.port), latency_s=0.05) as proxy, connect(proxy) as sock:
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
    finally:
        server.close()
    assert received == b"hello and goodbye"


def test_import_needs_only_the_standard_library() -> None:
    """Importing ovshard.runtime.tools.wanproxy loads no module outside the standard library and ovshard."""
    code = (
        "import sys; before = set(sys.modules); import ovshard.runtime.tools.wanproxy; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'ovshard'}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env={**os.environ, "CI": "true"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ovshard.cli", "proxy", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "CI": "true"})


def test_cli_relays_and_stops_cleanly_on_ctrl_c(echo_server: Server) -> None:
    """`ovshard proxy` relays with its latency, and SIGINT ends it with exit 0 and no traceback."""
    proc = _start_cli("--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{echo_server.port}",
                      "--latency-ms", "30", "--bandwidth-mbit", "100")
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        match = re.search(r"relaying 127\.0\.0\.1:(\d+) ->", first)
        assert match, first
        with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=TIMEOUT_S) as sock:
            start = time.monotonic()
            sock.sendall(b"through the cli")
            assert recv_exactly(sock, 15) == b"through the cli"
            assert time.monotonic() - start >= 0.06
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "stopped: 15 bytes up, 15 bytes down" in stderr


def test_cli_rejects_a_target_without_port() -> None:
    """`--target nohost` exits non-zero with one line naming the option and the expected form."""
    proc = _start_cli("--target", "nohost")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert stderr.strip().splitlines() == [
        "ovshard proxy: error: --target 'nohost': expected host:port with a port from 0 to 65535, "
        "e.g. 127.0.0.1:7000"
    ]
