"""Many requests over one head: the submission API a server front end calls.

``Scheduler(head)`` runs as many requests at once as the KV blocks the stages granted the head hold
(client/admission.py: each request reserves its prompt plus its max_tokens), ``Scheduler(head, streams=N)``
at most N; the rest wait in submission order. ``submit(prompt, config)`` returns a
:class:`~ovshard.runtime.scheduling.requests.Request` at once; when admission lets it start, it goes to the
head's engine (scheduling/engine.py), whose one loop runs every request, over paged and stateful stages alike.
Tokens arrive on the Request as they are sampled (``tokens()`` iterates them), so an HTTP server can stream them
to its client. ``cancel()`` ends a running request at the
engine's next tick boundary (its KV blocks freed at once) and takes a waiting one out of the queue at once.

Fairness: no waiting request is overtaken; the engine plans the oldest sequences first and splits them into
equal groups over the ticks in flight, so running requests take turns and a long one never holds up a short one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ovshard.errors import OvshardError
from ovshard.runtime.client.admission import Admission, Pool, Refused
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.local_head import LocalHead
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.requests import Request


class Busy(OvshardError):
    """The queue is full: try again in ``retry_after`` seconds (client/admission.py says how that is estimated)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Scheduler:
    """Requests over one Head (or a LocalHead: the stages in this process), as many at once as :class:`Admission` lets start, the rest waiting in order.

    ``streams``: at most this many at once (None: as many as the KV blocks the stages granted the head hold;
    client/admission.py); ``max_queue``: requests that may wait (None: no limit), beyond it ``submit`` raises
    :class:`Busy`.
    """

    def __init__(self, head: Head | LocalHead, streams: int | None = None, speculation: Speculation | None = None,
                 max_queue: int | None = None) -> None:
        if head.engine is None:
            raise OvshardError("a scheduler needs a head with batching settings (an engine); this one is a probe's")
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

    def pool(self) -> Pool:
        """The KV blocks the head's planner holds now (over stateful stages: one a stream slot)."""
        engine = self.head.engine
        assert engine is not None, "__init__ refuses a head without an engine"
        blocks = engine.blocks
        return Pool(blocks.num_blocks, blocks.block_size, engine.config.max_seqs,
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
            request.on_cancel.append(self._withdraw)
            starting = [self.requests[i] for i in verdict]
        self._launch(starting)
        return request

    def close(self) -> None:
        """Wait until every request submitted has ended."""
        with self.lock:
            while self.requests:
                self.idle.wait()

    def _launch(self, requests: list[Request]) -> None:
        """Each request that starts now to the head's engine."""
        engine = self.head.engine
        assert engine is not None, "__init__ refuses a head without an engine"
        for request in requests:
            request.started = time.perf_counter()
            engine.submit(request, self.speculation, self._finished)

    def _finished(self, request: Request) -> None:
        """The engine ended ``request``: its place goes to the next ones."""
        self._retire(request, self.admission.finish)

    def _withdraw(self, request: Request) -> None:
        """``request`` was cancelled: if it still waits, it leaves the queue and ends now (a running one ends
        at the engine's next event)."""
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
        request.end()
        self._launch(starting)

    def run_all(self, prompts: list[list[int]], config: SamplingConfig) -> list[Request]:
        """Submit every prompt and wait for all of them; failed requests carry their error."""
        requests = [self.submit(prompt, config) for prompt in prompts]
        for request in requests:
            request._done.wait()
        return requests

