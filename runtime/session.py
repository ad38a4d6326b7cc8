"""Many requests over a fixed number of concurrent streams: the API a server front end calls.

``Session(head, streams=4)`` starts one thread per stream slot. ``submit(prompt, config)`` queues a
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
from collections.abc import Iterator
from dataclasses import dataclass, field

from ovshard.errors import OvshardError
from ovshard.runtime.decode import Stats
from ovshard.runtime.head import Head
from ovshard.runtime.sampler import SamplingConfig
from ovshard.runtime.speculative import Speculation

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
    _tokens: list[int] = field(default_factory=list)
    _feed: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)

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
        """"stop" (an eos id), "length" (max_tokens or a full context), "error", or "" while running."""
        return "error" if self.error is not None else self.stats.finish_reason

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the whole generation."""
        if not self._done.wait(timeout):
            raise OvshardError(f"request {self.index} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self._tokens)


class Session:
    """``streams`` concurrent streams over one Head; requests queue until a stream is free."""

    def __init__(self, head: Head, streams: int = 1, speculation: Speculation | None = None) -> None:
        if streams < 1:
            raise OvshardError(f"--streams {streams}: expected at least 1 concurrent stream")
        self.head, self.speculation = head, speculation
        self.queue: queue.Queue = queue.Queue()
        self.submitted = 0
        self.slots = [threading.Thread(target=self._serve, name=f"stream-slot-{i}", daemon=True)
                      for i in range(streams)]
        for slot in self.slots:
            slot.start()

    def submit(self, prompt: list[int], config: SamplingConfig) -> Request:
        request = Request(self.submitted, list(prompt), config)
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
            try:
                for token in self.head.generate(request.prompt, request.config, request.stats, self.speculation):
                    request._tokens.append(token)
                    request._feed.put(token)
            except OvshardError as e:
                request.error = e
            except Exception as e:  # never let a slot thread die: the request carries what went wrong
                request.error = OvshardError(f"request {request.index} failed: {type(e).__name__}: {e}")
            finally:
                request.finished = time.perf_counter()
                request._feed.put(_DONE)
                request._done.set()

    def run_all(self, prompts: list[list[int]], config: SamplingConfig) -> list[Request]:
        """Submit every prompt and wait for all of them; failed requests carry their error."""
        requests = [self.submit(prompt, config) for prompt in prompts]
        for request in requests:
            request._done.wait()
        return requests
