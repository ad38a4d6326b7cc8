"""A worker's bookkeeping of who holds what: every head's session, its streams, and refusals.

A session is one head connection's share of a stage: the streams it opened (one KV cache each), its
link to the next stage, and the upstream links that carry its Steps. It lives exactly as long as its
head connection; :class:`Limits` caps how many of everything a worker grants.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ovshard.errors import OvshardError
from ovshard.runtime.engine.kv import KVCache
from ovshard.runtime.node.config import Limits
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
        self.grant: np.ndarray | None = None  # a paged stage's KV blocks for this session (batches.KVPool)
        self.lock = threading.Lock()

    def links(self) -> list[Connection]:
        with self.lock:
            return [c for c in [self.downstream, *self.upstream] if c is not None]


class HeadTable:
    """Every head's session at one stage, within the worker's :class:`Limits`: admitted, looked up, dropped;
    streams opened and found in them. Refusals are :class:`RequestError`s; nothing changes on a refusal."""

    def __init__(self, stage: int, limits: Limits) -> None:
        self.stage, self.limits = stage, limits
        self.sessions: dict[str, SessionState] = {}
        self.lock = threading.Lock()  # guards sessions and draining
        self.draining = False  # set once: no new session or stream

    def admit(self, session_id: str, head: Connection) -> SessionState:
        """A new head's session, unless the id is taken, the worker drains, or --max-sessions are open."""
        session = SessionState(session_id, head)
        with self.lock:
            if self.draining:
                raise RequestError("draining", "this worker is shutting down")
            if session_id in self.sessions:
                raise RequestError("refused", "session id in use; a head picks a fresh random one per connection")
            if len(self.sessions) >= self.limits.max_sessions:
                raise RequestError("busy", f"{self.limits.max_sessions} sessions open (--max-sessions); try later")
            self.sessions[session_id] = session
        return session

    def get(self, session_id: str) -> SessionState:
        """The session an upstream link names; its head must have connected first."""
        with self.lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise RequestError("refused", "unknown session: its head must connect to this stage first")
        return session

    def drop(self, session: SessionState) -> int:
        """The head is gone: forget the session, free its streams and close its links; the streams freed."""
        with self.lock:
            if self.sessions.get(session.id) is session:
                del self.sessions[session.id]
        with session.lock:
            freed = len(session.streams)
            session.streams.clear()
        for link in session.links():
            link.close()
        return freed

    def open_stream(self, session: SessionState, stream: int, new_cache: Callable[[], KVCache]) -> None:
        """Open ``stream`` in ``session`` with a cache of its own, within the per-session and worker caps."""
        with self.lock:
            total = sum(len(s.streams) for s in self.sessions.values())
            if self.draining:
                raise RequestError("draining", "this worker is shutting down")
        with session.lock:
            if stream in session.streams:
                raise RequestError("refused", f"stream {stream} is open already")
            if len(session.streams) >= self.limits.max_streams_per_session:
                raise RequestError("busy", f"{self.limits.max_streams_per_session} streams open in this session "
                                           "(--max-streams-per-session)")
            if total >= self.limits.max_streams:
                raise RequestError("busy", f"{self.limits.max_streams} streams open on this worker (--max-streams)")
            session.streams[stream] = new_cache()

    def stream(self, session: SessionState, stream: int) -> KVCache:
        """An open stream's cache, or the no_stream refusal that makes a head reopen and replay."""
        with session.lock:
            cache = session.streams.get(stream)
        if cache is None:
            raise RequestError("no_stream", f"stream {stream} is not open at stage {self.stage}; send Open first")
        return cache

    def counts(self) -> tuple[int, int]:
        """(sessions, streams) open now."""
        with self.lock:
            return len(self.sessions), sum(len(s.streams) for s in self.sessions.values())

    def drain(self) -> None:
        with self.lock:
            self.draining = True
