"""A connection closed by one thread while another is inside it keeps its descriptor until that thread leaves.

Closing the descriptor under a blocked reader frees its number for the next pipe or file the process opens,
and the reader's TLS library then writes its alert record there (CI saw 24 bytes of TLS at the start of a
subprocess's captured stdout after the head closed its connections).
"""

from __future__ import annotations

import socket
import threading

import pytest

from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.transport import Connection


def test_close_under_a_blocked_reader_shuts_the_socket_and_the_reader_releases_it() -> None:
    mine, theirs = socket.socketpair()
    conn = Connection(mine, "peer")
    woke: list[BaseException] = []
    entered = threading.Event()

    def read() -> None:
        entered.set()
        try:
            conn.receive()
        except BaseException as e:  # noqa: BLE001 - the test reads which one
            woke.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    entered.wait(5)
    conn.close()
    reader.join(5)
    assert not reader.is_alive() and isinstance(woke[0], (p.ConnectionClosed, OSError)), woke
    assert mine.fileno() == -1  # released by the reader on its way out
    assert theirs.recv(1) == b""  # the peer saw the shutdown
    theirs.close()


def test_the_descriptor_outlives_close_while_a_thread_is_inside() -> None:
    mine, theirs = socket.socketpair()
    conn = Connection(mine, "peer")
    with conn._using():  # a reader or sender inside the socket
        conn.close()
        assert mine.fileno() != -1, "the descriptor was freed under a thread still using it"
        assert theirs.recv(1) == b""  # shut down at once: the peer and the blocked thread wake
    assert mine.fileno() == -1
    with pytest.raises(OSError, match="was closed"):
        conn.send(p.Ping(1))
    theirs.close()
