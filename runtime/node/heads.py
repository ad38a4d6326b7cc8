"""A worker's bookkeeping of who holds what: its limits, one head's session, and refusals.

A session is one head connection's share of a stage: the streams it opened (one KV cache each), its
link to the next stage, and the upstream links that carry its Steps. It lives exactly as long as its
head connection; :class:`Limits` caps how many of everything a worker grants.
"""

from __future__ import annotations

import threading

from ovshard.errors import OvshardError
from ovshard.runtime.engine.kv import KVCache
from ovshard.runtime.wire.transport import Connection


class RequestError(OvshardError):
    """A well-formed request this stage cannot serve; answered with Error ``code``, connection kept."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SessionState:
    """One head's session at this stage: its head connection, streams, and link to the next stage."""

    def __init__(self, session_id: str, head: Connection) -> None:
        self.id, self.head = session_id, head
        self.streams: dict[int, KVCache] = {}
        self.downstream: Connection | None = None
        self.next_hop: str | None = None
        self.upstream: list[Connection] = []
        self.lock = threading.Lock()

    def links(self) -> list[Connection]:
        with self.lock:
            return [c for c in [self.downstream, *self.upstream] if c is not None]
