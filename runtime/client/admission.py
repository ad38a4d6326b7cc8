"""Admission of requests to one head: how many run at once, which wait, which are refused and for how long.

Pure bookkeeping, no threads, sockets or clocks of its own (the request scheduler, client/scheduler.py, calls it
under its lock with the time). Requests wait in one FIFO queue and only the oldest may start, so none is
overtaken and none starves; a request that leaves the queue (its client went away) lets those behind it move.

**By memory** (``streams=None``, the default): a request reserves the KV blocks its whole answer may take,

    need = ceil(min(prompt + max_tokens, max_positions) / block_size)

and starts once the reservations of the requests running plus its need fit the blocks every stage granted the
head (``Pool.blocks``), while fewer than ``Pool.max_seqs`` run (the planner's sequences at once). One request
always starts when none runs, even one larger than the pool (the engine's planner then preempts, or fails it with an
error saying so; never an out-of-memory crash). Stateful stages grant no blocks: their head plans in one block
of max_positions a stream slot (client/streams.py), so a request needs one there. With no pool at all
(``pool=None``), STATEFUL_STREAMS run at once.

**A fixed count** (``streams=N``, ``--streams``): at most N run, whatever their size; the planner makes the
surplus wait for blocks, or preempts.

**The queue**: at most ``queue`` requests wait (None: no limit); one more is :class:`Refused` with
``retry_after``, whole seconds, at least 1: when the requests waiting now and this one would all have started,
at the rate requests finished lately (a finish lets the oldest waiting one start)::

    retry_after = ceil((waiting + 1) / rate)      rate = finished / span over the last WINDOW_S seconds
                                                  (span starts no earlier than the head last became busy)

Before any request finished in that span: ``ceil((waiting + 1) * age / running)``, where ``age`` is how long
the oldest running request has run (each running one is taken to need as long again).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from ovshard.errors import OvshardError
from ovshard.runtime.engine.paged import blocks_for

__all__ = ["DEFAULT_QUEUE", "STATEFUL_STREAMS", "WINDOW_S", "Admission", "Pool", "Refused"]

STATEFUL_STREAMS = 4  # requests at once when no pool is known to size them by
# Requests that may wait by default: a waiting request holds only its connection and its prompt's ids, so a
# burst this far past what runs is served in turn rather than refused
DEFAULT_QUEUE = 1024
WINDOW_S = 30.0  # the span the drain rate of Retry-After is measured over


@dataclass(frozen=True)
class Pool:
    """What one head may hold on its stages: ``blocks`` KV blocks of ``block_size`` positions (the fewest any
    stage granted), ``max_seqs`` sequences at once (the planner's), ``max_positions`` of the bundle."""

    blocks: int
    block_size: int
    max_seqs: int
    max_positions: int

    def need(self, positions: int) -> int:
        """Blocks a request of ``positions`` (prompt + max_tokens) may take: never more than a full context."""
        return blocks_for(min(positions, self.max_positions), self.block_size)


@dataclass(frozen=True)
class Refused:
    """The queue is full: ``running`` run, ``waiting`` wait; come back in ``retry_after`` seconds."""

    running: int
    waiting: int
    retry_after: int


class Admission:
    """The waiting queue and the running set of one head, and the admission rule (the module docstring)."""

    def __init__(self, streams: int | None = None, queue: int | None = DEFAULT_QUEUE,
                 window_s: float = WINDOW_S) -> None:
        if streams is not None and streams < 1:
            raise OvshardError(f"--streams {streams}: expected at least 1 request at once, or leave it out to "
                               "size it by the KV memory the stages hold")
        if queue is not None and queue < 0:
            raise OvshardError(f"--queue {queue}: expected a number of waiting requests >= 0")
        self.streams, self.queue, self.window_s = streams, queue, window_s
        self._waiting: OrderedDict[int, int] = OrderedDict()  # key -> positions, oldest first
        self._running: dict[int, tuple[int, float]] = {}  # key -> (positions, started at)
        self._finished: deque[float] = deque()  # finish times within the window, oldest first
        self._busy_since = 0.0  # when the running set last became non-empty

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def is_waiting(self, key: int) -> bool:
        return key in self._waiting

    def reserved(self, pool: Pool) -> int:
        """Blocks the running requests reserve in ``pool``."""
        return sum(pool.need(positions) for positions, _ in self._running.values())

    def offer(self, key: int, positions: int, pool: Pool | None, now: float) -> list[int] | Refused:
        """A new request of ``positions`` (prompt + max_tokens) joins the queue: the keys that start now (it may
        be among them), or :class:`Refused` (and nothing changed) when it would wait beyond ``queue``."""
        if key in self._waiting or key in self._running:
            raise OvshardError(f"request {key!r} was offered twice")
        self._waiting[key] = positions
        started = self.start(pool, now)
        if key in self._waiting and self.queue is not None and len(self._waiting) > self.queue:
            del self._waiting[key]  # the newest, last in the queue: nothing behind it moved
            return Refused(len(self._running), len(self._waiting), self.retry_after(now))
        return started

    def start(self, pool: Pool | None, now: float) -> list[int]:
        """The oldest waiting requests that fit now, moved to the running set, in order."""
        started: list[int] = []
        while self._waiting:
            key, positions = next(iter(self._waiting.items()))
            if not self.fits(positions, pool):
                break
            del self._waiting[key]
            if not self._running:
                self._busy_since = now
            self._running[key] = (positions, now)
            started.append(key)
        return started

    def fits(self, positions: int, pool: Pool | None) -> bool:
        """Whether a request of ``positions`` may start beside those running (the admission rule)."""
        running = len(self._running)
        if self.streams is not None:
            return running < self.streams
        if pool is None:
            return running < STATEFUL_STREAMS
        if running == 0:
            return True
        return running < pool.max_seqs and self.reserved(pool) + pool.need(positions) <= pool.blocks

    def finish(self, key: int, pool: Pool | None, now: float) -> list[int]:
        """Running request ``key`` ended (done, failed or cancelled): the keys that start in its place."""
        if self._running.pop(key, None) is None:
            raise OvshardError(f"request {key!r} is not running")
        self._finished.append(now)
        self._forget_before(now - self.window_s)
        return self.start(pool, now)

    def withdraw(self, key: int, pool: Pool | None, now: float) -> list[int] | None:
        """Waiting request ``key`` leaves the queue (its client went away): the keys that start now that it no
        longer holds up those behind it; None when it was not waiting (running, or gone)."""
        if self._waiting.pop(key, None) is None:
            return None
        return self.start(pool, now)

    def retry_after(self, now: float) -> int:
        """Whole seconds, at least 1, until the requests waiting now and one more would have started."""
        self._forget_before(now - self.window_s)
        since = max(now - self.window_s, self._busy_since)
        finished = sum(1 for t in self._finished if t >= since)
        ahead = len(self._waiting) + 1
        if finished:
            seconds = ahead * (now - since) / finished
        elif self._running:
            age = now - min(started for _, started in self._running.values())
            seconds = ahead * age / len(self._running)
        else:
            seconds = 0.0
        return max(1, math.ceil(seconds))

    def _forget_before(self, oldest: float) -> None:
        while self._finished and self._finished[0] < oldest:
            self._finished.popleft()
