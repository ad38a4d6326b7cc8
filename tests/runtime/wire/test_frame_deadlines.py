"""Deadlines: a frame that has begun must arrive whole in time; waiting for one to begin is the caller's."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from protocol_frames import EXAMPLES

from ovshard.runtime.wire.framing import (
    encode,
    read_message,
)
from ovshard.runtime.wire.protocol import (
    Ping,
    ProtocolError,
)


def test_a_frame_one_byte_short_times_out() -> None:
    """A frame left one byte short is refused as timeout once deadline_s passes, not waited on forever."""
    data = encode(EXAMPLES[7])
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data[:-1])
        start = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            read_message(b, deadline_s=0.5)
        waited = time.monotonic() - start
    assert e.value.code == "timeout"
    assert 0.45 <= waited < 3.0


def dribble(data: bytes, gap_s: float, deadline_s: float) -> tuple[ProtocolError, float]:
    """Send ``data`` one byte every ``gap_s`` over a socket pair while read_message(deadline_s=) reads it:
    the reader's error and how long after the first byte it came."""
    a, b = socket.socketpair()
    stop = threading.Event()
    first = threading.Event()
    started: list[float] = []

    def send() -> None:
        for byte in data:
            try:
                a.send(bytes([byte]))
            except OSError:
                return
            if not first.is_set():
                started.append(time.monotonic())
                first.set()
            if stop.wait(gap_s):
                return

    writer = threading.Thread(target=send)
    with a, b:
        writer.start()
        try:
            with pytest.raises(ProtocolError) as e:
                read_message(b, deadline_s=deadline_s)
            ended = time.monotonic()
        finally:
            stop.set()
            writer.join()
    return e.value, ended - started[0]


def test_a_frame_dribbled_byte_by_byte_cannot_outlast_its_deadline() -> None:
    """A peer sending one byte every 50 ms (each recv in time) is cut off at the deadline, inside the prefix."""
    refused, waited = dribble(encode(Ping(1)), 0.05, 0.5)  # the whole 37-byte frame would take 1.85 s
    assert refused.code == "timeout"
    assert waited < 0.5 + 0.3


def test_the_deadline_counts_from_the_first_byte_of_the_frame() -> None:
    """A frame whose prefix arrives just in time (16 bytes in 0.45 s) must still be whole 0.5 s after its first byte."""
    refused, waited = dribble(encode(Ping(1)), 0.03, 0.5)  # prefix by 0.45 s, whole frame by 1.08 s
    assert refused.code == "timeout"
    assert waited < 0.5 + 0.3


def test_waiting_for_a_frame_to_begin_raises_timeout_error() -> None:
    """With idle_s and nothing sent, read_message raises TimeoutError (the caller's business), not ProtocolError."""
    a, b = socket.socketpair()
    with a, b:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            read_message(b, deadline_s=5, idle_s=0.2)
        waited = time.monotonic() - start
        assert b.gettimeout() == 0.2
    assert not isinstance(e.value, ProtocolError)
    assert 0.15 <= waited < 2.0
