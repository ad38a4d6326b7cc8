"""A request as its reader sees it, and the phases the engine moves it through.

A :class:`Request` is what a front end (the API, chat, ``run``, ``generate``) submits and reads: its tokens as
they are sampled (``tokens()``, or a ``listener``), ``cancel()``, ``finish_reason``, ``stats`` and, once done,
``result()``. The engine (engine.py) owns everything else about it and records each change of :class:`Phase`::

    waiting -> prefilling -> decoding -> finished          (stop, length, cancelled, error)
                   ^  |          |
                   |  +----------+--> preempted            (the planner took its KV blocks back)
                   +-- replaying <---------------------     (its chain broke or a stage refused its rows)

A *paced* request (``Head.generate``'s) runs at most one step ahead of its reader: its next step waits while
the reader has not read the tokens of the step before, so the reader's work overlaps one step's compute and an
abandoned reader costs one step; others run as fast as the engine goes.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ovshard.errors import OvshardError
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.engine.sampler import SamplingConfig

_DONE = object()


class Phase(enum.Enum):
    WAITING = "waiting"  # submitted, no KV blocks yet
    PREFILLING = "prefilling"  # its prompt (or its whole history, after a replay or a preemption) is being fed
    DECODING = "decoding"  # a row a tick: its next token, and its drafts when speculation is on
    PREEMPTED = "preempted"  # its blocks were taken back; it is recomputed when blocks free up
    REPLAYING = "replaying"  # it starts again as a new sequence holding its whole history
    FINISHED = "finished"


@dataclass
class Request:
    """One submitted generation: its tokens as they come, its stats, and its error if it failed (the
    tokens generated before the failure stay in ``partial``)."""

    index: int
    prompt: list[int]
    config: SamplingConfig
    stats: Stats = field(default_factory=Stats)
    submitted: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    error: Exception | None = None
    listener: Callable[[int | None], None] | None = None  # called with each token, then None at the end
    cancelled: bool = False  # set by cancel()
    started: float | None = None  # when it started running
    paced: bool = False  # at most one step ahead of its reader (the module docstring)
    phases: list[Phase] = field(default_factory=lambda: [Phase.WAITING])  # every phase it went through
    on_cancel: list[Callable[[Request], None]] = field(default_factory=list)  # who hears cancel()
    on_read: Callable[[Request], None] | None = None  # the engine's: the reader wants more tokens
    _tokens: list[int] = field(default_factory=list)
    _read: int = 0  # tokens the reader has taken from the feed
    _feed: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away): a running request leaves at the next tick boundary (its KV
        blocks freed at once), a waiting one leaves the queue at once."""
        self.cancelled = True
        for hook in list(self.on_cancel):
            hook(self)

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def unread(self) -> bool:
        """Whether tokens were delivered that the reader has not taken yet."""
        return self._read < len(self._tokens)

    def tokens(self) -> Iterator[int]:
        """The generated tokens as they are sampled; raises the request's error, if any, at the end."""
        while True:
            try:
                item = self._feed.get_nowait()
            except queue.Empty:
                if self.on_read is not None:
                    self.on_read(self)
                item = self._feed.get()
            if item is _DONE:
                break
            self._read += 1
            yield item
        if self.error is not None:
            raise self.error

    @property
    def partial(self) -> list[int]:
        """The tokens generated so far (all of them once finished, also when it failed)."""
        return list(self._tokens)

    @property
    def finish_reason(self) -> str:
        """"stop" (an eos id), "length" (max_tokens or a full context), "error", "cancelled", or "" while
        running."""
        if self.error is not None:
            return "error"
        return "cancelled" if self.cancelled and not self.stats.finish_reason else self.stats.finish_reason

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the whole generation."""
        if not self._done.wait(timeout):
            raise OvshardError(f"request {self.index} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self._tokens)

    # ----- the side that runs it (the engine) -----
    def move(self, phase: Phase) -> None:
        if self.phases[-1] is not phase:
            self.phases.append(phase)

    def deliver(self, token: int) -> None:
        self._tokens.append(token)
        self.stats.new_tokens = len(self._tokens)
        self._feed.put(token)
        if self.listener is not None:
            self.listener(token)

    def end(self, error: Exception | None = None) -> None:
        """Mark it finished and tell whoever reads it."""
        if self.done:
            return
        self.error = self.error or error
        self.finished = time.perf_counter()
        self.move(Phase.FINISHED)
        self._feed.put(_DONE)
        self._done.set()
        if self.listener is not None:
            self.listener(None)
