"""A worker's bookkeeping of who holds what: its limits, one head's session, and refusals.

A session is one head connection's share of a stage: the streams it opened (one KV cache each), its
link to the next stage, and the upstream links that carry its Steps. It lives exactly as long as its
head connection; :class:`Limits` caps how many of everything a worker grants.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ovshard.errors import OvshardError
from ovshard.runtime.framing import DEFAULT_MAX_FRAME
from ovshard.runtime.kv import KVCache
from ovshard.runtime.transport import HANDSHAKE_TIMEOUT_S, Connection


@dataclass(frozen=True)
class Limits:
    """What one worker grants: anything beyond is refused with an Error, never allocated."""

    max_connections: int = 256
    max_sessions: int = 64
    max_streams: int = 256  # over all sessions
    max_streams_per_session: int = 32
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # TLS handshake and Hello, from accept
    frame_timeout_s: float = 30.0  # a frame that has begun must be whole within this (+ 1 s per MiB)
    pre_auth_frame_bytes: int = 4096  # the Hello's frame
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    drain_s: float = 30.0  # how long SIGTERM waits for in-flight steps

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_sessions", "max_streams", "max_streams_per_session"):
            if getattr(self, name) < 1:
                raise OvshardError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected at least 1")
        if self.frame_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise OvshardError("--frame-timeout and the handshake timeout must be positive seconds")


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
