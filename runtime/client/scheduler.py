"""Many requests over a fixed number of concurrent streams: the API a server front end calls.

``Scheduler(head, streams=4)`` starts one thread per stream slot. ``submit(prompt, config)`` queues a
request and returns a :class:`Request` at once; a free slot takes requests in submission order and
runs each on a stream of its own (its own KV cache at every stage). Tokens arrive on the Request as
they are sampled (``tokens()`` iterates them), so an HTTP server can stream them to its client.

Fairness: a stream has one step in flight at a time and every stage serves steps in arrival order,
so active streams take turns at each stage; a long request never holds up a short one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig

_DONE = object()


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
    cancelled: bool = False  # set by cancel(): the slot stops after the current step and frees the stream
    started: float | None = None  # when a slot took it
    _tokens: list[int] = field(default_factory=list)
    _feed: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away); the stream is closed on every stage."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def tokens(self) -> Iterator[int]:
        """The generated tokens as they are sampled; raises the request's error, if any, at the end."""
        while (item := self._feed.get()) is not _DONE:
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


class Busy(OvshardError):
    """Every stream slot is busy and the queue is full: try again later."""


class Scheduler:
    """``streams`` concurrent streams over one Head; requests queue until a stream is free.

    ``max_queue`` (None: unbounded) is how many requests may wait for a slot; beyond it ``submit``
    raises :class:`Busy`.
    """

    def __init__(self, head: Head, streams: int = 1, speculation: Speculation | None = None,
                 max_queue: int | None = None) -> None:
        if streams < 1:
            raise OvshardError(f"--streams {streams}: expected at least 1 concurrent stream")
        if max_queue is not None and max_queue < 0:
            raise OvshardError(f"--queue {max_queue}: expected a number of waiting requests >= 0")
        self.head, self.speculation, self.streams, self.max_queue = head, speculation, streams, max_queue
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.active = 0  # requests a slot is running
        self.submitted = 0
        self.slots = [threading.Thread(target=self._serve, name=f"stream-slot-{i}", daemon=True)
                      for i in range(streams)]
        for slot in self.slots:
            slot.start()

    @property
    def waiting(self) -> int:
        return self.queue.qsize()

    def submit(self, prompt: list[int], config: SamplingConfig,
               listener: Callable[[int | None], None] | None = None) -> Request:
        with self.lock:
            if self.max_queue is not None and self.active >= self.streams and self.waiting >= self.max_queue:
                raise Busy(f"all {self.streams} streams are busy and {self.waiting} requests wait (the queue "
                           f"holds {self.max_queue}); try again later")
            request = Request(self.submitted, list(prompt), config, listener=listener)
            self.submitted += 1
            self.queue.put(request)
        return request

    def close(self) -> None:
        """Let the slots finish what is queued, then stop them."""
        for _ in self.slots:
            self.queue.put(None)
        for slot in self.slots:
            slot.join()

    def _serve(self) -> None:
        while (request := self.queue.get()) is not None:
            with self.lock:
                self.active += 1
            request.started = time.perf_counter()
            try:
                if not request.cancelled:
                    self._run(request)
            except OvshardError as e:
                request.error = e
            except Exception as e:  # never let a slot thread die: the request carries what went wrong
                request.error = OvshardError(f"request {request.index} failed: {type(e).__name__}: {e}")
            finally:
                with self.lock:
                    self.active -= 1
                request.finished = time.perf_counter()
                request._feed.put(_DONE)
                request._done.set()
                if request.listener is not None:
                    request.listener(None)

    def _run(self, request: Request) -> None:
        tokens: Generator[int, None, None] = self.head.generate(request.prompt, request.config, request.stats,
                                                                self.speculation)
        try:
            for token in tokens:
                request._tokens.append(token)
                request._feed.put(token)
                if request.listener is not None:
                    request.listener(token)
                if request.cancelled:
                    break
        finally:
            tokens.close()  # closes the stream on every stage

    def run_all(self, prompts: list[list[int]], config: SamplingConfig) -> list[Request]:
        """Submit every prompt and wait for all of them; failed requests carry their error."""
        requests = [self.submit(prompt, config) for prompt in prompts]
        for request in requests:
            request._done.wait()
        return requests
