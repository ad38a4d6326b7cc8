"""Many requests over one head: the API a server front end calls.

``Scheduler(head)`` runs as many requests at once as the KV blocks the stages granted the head hold
(client/admission.py: each request reserves its prompt plus its max_tokens), ``Scheduler(head, streams=N)``
at most N; the rest wait in submission order. ``submit(prompt, config)`` returns a :class:`Request` at once;
when it may start, a thread of its own runs it on a stream of its own. Tokens arrive on the Request as they
are sampled (``tokens()`` iterates them), so an HTTP server can stream them to its client. ``cancel()`` ends
a running request after its current step (its stream is closed and its KV blocks freed on every stage) and
takes a waiting one out of the queue at once.

Fairness: no waiting request is overtaken; a stream has one step in flight at a time and every stage serves
steps in arrival order, so running requests take turns at each stage and a long one never holds up a short one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from ovshard.errors import OvshardError
from ovshard.runtime.client.admission import Admission, Pool, Refused
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
    cancelled: bool = False  # set by cancel(): a running request stops after its current step
    started: float | None = None  # when it started running
    _leave: Callable[[Request], None] | None = None  # the scheduler's: a cancelled request leaves its queue
    _tokens: list[int] = field(default_factory=list)
    _feed: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (the client went away): a running request after its current step (its stream is
        closed on every stage), a waiting one at once."""
        self.cancelled = True
        if self._leave is not None:
            self._leave(self)

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
    """The queue is full: try again in ``retry_after`` seconds (client/admission.py says how that is estimated)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Scheduler:
    """Requests over one Head, as many at once as :class:`Admission` lets start, the rest waiting in order.

    ``streams``: at most this many at once (None: as many as the KV blocks the stages granted the head hold;
    client/admission.py); ``max_queue``: requests that may wait (None: no limit), beyond it ``submit`` raises
    :class:`Busy`. Each running request has a thread of its own, which ends with it.
    """

    def __init__(self, head: Head, streams: int | None = None, speculation: Speculation | None = None,
                 max_queue: int | None = None) -> None:
        self.head, self.speculation = head, speculation
        self.admission = Admission(streams, max_queue)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified whenever a request leaves
        self.requests: dict[int, Request] = {}  # waiting or running, by index
        self.submitted = 0

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def active(self) -> int:
        """Requests running now."""
        return self.admission.running

    def pool(self) -> Pool | None:
        """The KV blocks the head holds on its stages now (None: stateful stages, no pool)."""
        batcher = self.head.chain.batcher
        if batcher is None:
            return None
        blocks = batcher.scheduler.blocks
        return Pool(blocks.num_blocks, blocks.block_size, batcher.scheduler.config.max_seqs,
                    self.head.manifest.runtime_hints.max_positions)

    def submit(self, prompt: list[int], config: SamplingConfig,
               listener: Callable[[int | None], None] | None = None) -> Request:
        """Queue a request; it starts at once if it may. Raises :class:`Busy` when the queue is full."""
        with self.lock:
            request = Request(self.submitted, list(prompt), config, listener=listener)
            verdict = self.admission.offer(request.index, len(prompt) + config.max_tokens, self.pool(),
                                           time.monotonic())
            if isinstance(verdict, Refused):
                raise Busy(f"busy: {verdict.running} running and {verdict.waiting} waiting, as many as the queue "
                           f"holds; try again in {verdict.retry_after} s", verdict.retry_after)
            self.submitted += 1
            self.requests[request.index] = request
            request._leave = self._withdraw
            starting = [self.requests[i] for i in verdict]
        self._launch(starting)
        return request

    def close(self) -> None:
        """Wait until every request submitted has ended."""
        with self.lock:
            while self.requests:
                self.idle.wait()

    def _launch(self, requests: list[Request]) -> None:
        """A thread for each request that starts now."""
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name=f"request-{request.index}", daemon=True).start()

    def _withdraw(self, request: Request) -> None:
        """``request`` was cancelled: if it still waits, it leaves the queue and ends now (a running one ends
        after its current step, on its own thread)."""
        self._retire(request, self.admission.withdraw)

    def _retire(self, request: Request, leave: Callable[[int, Pool | None, float], list[int] | None]) -> None:
        """``request`` leaves admission by ``leave`` (finish or withdraw; None: it could not leave that way),
        then ends, and the requests admission lets in after it start."""
        with self.lock:
            started = leave(request.index, self.pool(), time.monotonic())
            if started is None:
                return
            del self.requests[request.index]
            starting = [self.requests[i] for i in started]
            self.idle.notify_all()
        _end(request)
        self._launch(starting)

    def _serve(self, request: Request) -> None:
        """The thread of one running request: its generation, then its place handed on."""
        request.started = time.perf_counter()
        try:
            if not request.cancelled:
                self._run(request)
        except OvshardError as e:
            request.error = e
        except Exception as e:  # never let a request's thread die silently: the request carries what went wrong
            request.error = OvshardError(f"request {request.index} failed: {type(e).__name__}: {e}")
        finally:
            self._retire(request, self.admission.finish)

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


def _end(request: Request) -> None:
    """Mark ``request`` finished and tell whoever reads it."""
    request.finished = time.perf_counter()
    request._feed.put(_DONE)
    request._done.set()
    if request.listener is not None:
        request.listener(None)
