"""Bytes for tests/fuzz_worker.py to throw at a worker, and the socket chores around them: random and mutated
frames, Hellos the worker must refuse, reading replies in time, half-closes and resets.
"""

from __future__ import annotations

import io
import json
import random
import socket
import struct

from fuzz_session import SessionModel, Spec

from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import PREFIX, read_message

REPLY_TIMEOUT_S = 30.0


class QuickAck:
    """A socket read with TCP_QUICKACK before every recv, so this end acknowledges at once.

    The worker's accepted sockets keep Nagle's algorithm on, so a second reply sent before the first is
    acknowledged waits for the ACK, which Linux delays up to 40 ms: 44 ms for any two back-to-back replies
    instead of 0.2 ms. Acking at once keeps the fuzz fast (the worker should set TCP_NODELAY; see the report).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def read(self, n: int) -> bytes:
        if hasattr(socket, "TCP_QUICKACK"):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return self.sock.recv(n)


def receive(sock: socket.socket) -> p.Message:
    """The next frame from the worker, waiting at most REPLY_TIMEOUT_S (TimeoutError) for it to begin."""
    sock.settimeout(REPLY_TIMEOUT_S)
    return read_message(QuickAck(sock))  # type: ignore[arg-type]


def session_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def half_close(sock: socket.socket) -> None:
    """No more frames from us; the worker may have reset the connection already (it refused the frame)."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def close(sock: socket.socket, abort: bool) -> None:
    """Close; with ``abort`` as a reset (SO_LINGER 0: the worker sees ECONNRESET, no TIME_WAIT here)."""
    if abort:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    sock.close()


def refused_hello(spec: Spec, rng: random.Random, live: SessionModel | None) -> p.Hello:
    """A well-formed Hello this worker must refuse (Error "refused")."""
    session, fp, v = session_id(rng), spec.fingerprint, p.PROTOCOL_VERSION
    choices = [p.Hello("head", v, fp, rng.choice([1, 2, 2**63 - 1]), session),  # another stage
               p.Hello("head", v, "sha256:" + "0" * 64, 0, session),  # another bundle
               p.Hello("upstream", v, fp, 0, session),  # a link for a session nobody opened
               p.Hello("upstream", v, fp, 0, session, "127.0.0.1:1"),  # an upstream naming a next hop
               p.Hello("head", rng.choice([0, v - 1, v + 1, 2**63 - 1]), fp, 0, session)]  # a Hello of another protocol
    if live is not None:
        choices.append(p.Hello("head", v, fp, 0, live.session))  # a session in use
    return rng.choice(choices)


def decode_all(blob: bytes, max_frame: int) -> tuple[list[p.Message], p.ProtocolError | p.ConnectionClosed | None]:
    """The messages the worker's reader finds in ``blob``, and what stops it (None: the blob ended cleanly)."""
    stream, messages = io.BytesIO(blob), []
    while True:
        try:
            messages.append(read_message(stream, max_frame))
        except p.ConnectionClosed as e:
            return messages, (None if e.clean else e)
        except p.ProtocolError as e:
            return messages, e


def drain(sock: socket.socket) -> None:
    try:
        while receive(sock):
            pass
    except (p.ConnectionClosed, p.ProtocolError, OSError):
        pass


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice([rng.randrange(1, 17), rng.randrange(17, 64), rng.randrange(64, 5000)])
    data = rng.randbytes(n)
    if rng.random() < 0.5:  # behind a plausible prefix, so the reader gets past the magic
        data = PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, rng.choice(sorted(p.KINDS)), 0, min(n, 4000), 0) + data
    return data


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """One of: bit flips, a byte replaced, a cut, a length changed (a little or to a huge value), a byte inserted
    or deleted, a prefix field changed, a header field swapped for random JSON."""
    data, how = bytearray(frame), rng.randrange(8)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == 2:
        return bytes(data[:rng.randrange(len(data))])
    elif how == 3:
        at = rng.choice([8, 12])
        old = struct.unpack_from("<I", data, at)[0]
        new = rng.choice([old + rng.randint(-3, 3), rng.getrandbits(32), 2**32 - 1, 64 * 1024 + 1, 2**28])
        struct.pack_into("<I", data, at, max(0, min(new, 2**32 - 1)))
    elif how == 4:
        at = rng.randrange(16, len(data) + 1)
        data[at:at] = bytes([rng.randrange(256)])
    elif how == 5:
        del data[rng.randrange(16, len(data))]
    elif how == 6:
        data[rng.choice([0, 4, 6, 7])] = rng.randrange(256)
    else:
        return swap_field(frame, rng)
    return bytes(data)


def swap_field(frame: bytes, rng: random.Random) -> bytes:
    """The frame with one header field (or one key of its tensor spec) set to a random JSON value."""
    _, _, kind, _, header_len, _ = PREFIX.unpack(frame[:16])
    header, body = json.loads(frame[16:16 + header_len]), frame[16 + header_len:]
    target = header["tensor"] if "tensor" in header and rng.random() < 0.4 else header
    target[rng.choice(sorted(target) + ["extra"])] = rng.choice([
        None, True, -1, 0, 1, 2**31, 2**63, 2**64, 1.5, -0.0, "", "x" * 300, [], [1, 2], {}, {"a": 1},
        [1, 2**31 - 1], "i64", "f64", "argmax", "0" * 32])
    text = json.dumps(header).encode()
    return PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, kind, 0, len(text), len(body)) + text + body
