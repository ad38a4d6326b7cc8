"""Admission of requests to a head (runtime/client/admission.py), and the request scheduler over a fake head.

No sockets: the rule is pure bookkeeping, and the scheduler's threads run a fake head whose tokens the test
releases one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ovshard.errors import OvshardError
from ovshard.runtime.client.admission import STATEFUL_STREAMS, Admission, Pool, Refused
from ovshard.runtime.client.scheduler import Busy, Scheduler
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.scheduling.ticks import tick_budget

POOL = Pool(blocks=16, block_size=32, max_seqs=32, max_positions=512)  # 16 blocks: 8 requests of 37 positions


def started(result: list[int] | Refused) -> list[int]:
    assert not isinstance(result, Refused), result
    return result


def test_by_memory_as_many_run_as_their_prompt_and_max_tokens_fit_the_pool() -> None:
    """Requests of 5 + 32 positions take 2 blocks each: 8 of them fill 16 blocks, the 9th waits for a finish."""
    a = Admission(queue=None)
    assert [started(a.offer(i, 37, POOL, 0.0)) for i in range(9)] == [[i] for i in range(8)] + [[]]
    assert (a.running, a.waiting, a.reserved(POOL)) == (8, 1, 16)
    assert a.finish(3, POOL, 1.0) == [8]


def test_a_request_reserves_at_most_a_full_context() -> None:
    """A max_tokens past the bundle's positions reserves the blocks of max_positions, not more."""
    assert POOL.need(5 + 100_000) == 16 == POOL.need(512)
    a = Admission(queue=None)
    assert started(a.offer(0, 5 + 100_000, POOL, 0.0)) == [0]
    assert started(a.offer(1, 37, POOL, 0.0)) == []  # the first holds the whole pool


def test_one_request_runs_alone_even_when_larger_than_the_pool() -> None:
    """With nothing running a request starts whatever its size (the planner handles a pool too small)."""
    small = Pool(blocks=2, block_size=32, max_seqs=32, max_positions=512)
    a = Admission(queue=None)
    assert started(a.offer(0, 400, small, 0.0)) == [0]
    assert started(a.offer(1, 10, small, 0.0)) == []


def test_the_batchers_sequence_cap_bounds_what_runs() -> None:
    """Small requests stop at max_seqs running even when blocks are left."""
    a = Admission(queue=None)
    capped = Pool(blocks=1000, block_size=32, max_seqs=3, max_positions=512)
    assert [i for i in range(5) for _ in started(a.offer(i, 10, capped, 0.0))] == [0, 1, 2]


def test_no_request_overtakes_an_older_one() -> None:
    """A large request at the front waits for room and a small one behind it waits too, though it would fit."""
    a = Admission(queue=None)
    assert started(a.offer(0, 300, POOL, 0.0)) == [0]  # 10 blocks
    assert started(a.offer(1, 300, POOL, 0.0)) == []  # needs 10, 6 left
    assert started(a.offer(2, 10, POOL, 0.0)) == []  # 1 block would fit: it still waits behind 1
    assert a.finish(0, POOL, 1.0) == [1, 2]


def test_streams_fixes_the_count_whatever_the_memory() -> None:
    """--streams N runs N at once, large or small, and ignores the pool."""
    a = Admission(streams=2, queue=None)
    assert [started(a.offer(i, 512, POOL, 0.0)) for i in range(3)] == [[0], [1], []]


def test_stateful_stages_run_a_fixed_number() -> None:
    """Without a pool (stateful stages) STATEFUL_STREAMS run at once."""
    a = Admission(queue=None)
    runs = [i for i in range(STATEFUL_STREAMS + 2) for _ in started(a.offer(i, 37, None, 0.0))]
    assert runs == list(range(STATEFUL_STREAMS))


def test_a_full_queue_refuses_and_changes_nothing() -> None:
    """With --queue 2, the third waiting request is refused (running and waiting counts said); queue 0 still
    starts a request that fits now."""
    a = Admission(streams=1, queue=2)
    assert [started(a.offer(i, 37, POOL, 0.0)) for i in range(3)] == [[0], [], []]
    refused = a.offer(3, 37, POOL, 0.0)
    assert isinstance(refused, Refused) and (refused.running, refused.waiting) == (1, 2)
    assert (a.running, a.waiting) == (1, 2) and not a.is_waiting(3)
    none = Admission(queue=0)
    assert started(none.offer(0, 37, POOL, 0.0)) == [0]


def test_a_waiting_request_that_leaves_lets_those_behind_it_start() -> None:
    """Withdrawing the request at the front starts the one behind it; a running one is not withdrawn."""
    a = Admission(queue=None)
    a.offer(0, 300, POOL, 0.0)
    a.offer(1, 300, POOL, 0.0)
    a.offer(2, 10, POOL, 0.0)
    assert a.withdraw(1, POOL, 1.0) == [2]
    assert a.withdraw(0, POOL, 1.0) is None and a.running == 2 and a.waiting == 0


def test_retry_after_follows_the_drain_rate() -> None:
    """3 finishes over the 6 s since the head got busy, 2 waiting: the third after them starts in 6 s."""
    a = Admission(streams=3, queue=2)
    for i in range(5):
        a.offer(i, 37, POOL, 100.0)
    for i, t in enumerate((102.0, 104.0, 106.0)):
        a.finish(i, POOL, t)
        a.offer(10 + i, 37, POOL, t)
    refused = a.offer(99, 37, POOL, 106.0)
    assert isinstance(refused, Refused) and refused.retry_after == 6  # (2 + 1) * 6 s / 3 finishes


def test_retry_after_before_any_finish_and_never_below_a_second() -> None:
    """No finish yet: each of the running requests is taken to need as long again as the oldest ran; at least 1 s."""
    a = Admission(streams=2, queue=1)
    for i in range(3):
        a.offer(i, 37, POOL, 0.0)
    refused = a.offer(3, 37, POOL, 8.0)
    assert isinstance(refused, Refused) and refused.retry_after == 8  # (1 + 1) * 8 s / 2 running
    assert isinstance(r := a.offer(4, 37, POOL, 0.1), Refused) and r.retry_after == 1


def test_bad_limits_are_refused_with_the_option() -> None:
    """--streams 0 and --queue -1 are errors naming the option."""
    with pytest.raises(OvshardError, match="--streams 0"):
        Admission(streams=0)
    with pytest.raises(OvshardError, match="--queue -1"):
        Admission(queue=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.booleans()), min_size=1, max_size=40), st.randoms())
def test_requests_start_in_the_order_they_came_and_every_one_starts(jobs: list[tuple[int, bool]],
                                                                    rng: object) -> None:
    """Any sizes, finishes in any order, some leaving the queue: those that start do so in arrival order, the
    pool's blocks and sequence cap are never overrun but by one request alone, and every one ends."""
    a, began = Admission(queue=None), []
    for i, (positions, _) in enumerate(jobs):
        began += started(a.offer(i, positions, POOL, 0.0))
    leaving = []
    for i, (_, leaves) in enumerate(jobs):
        if leaves and a.is_waiting(i):
            leaving.append(i)
            began += a.withdraw(i, POOL, 0.0) or []
    running = list(began)
    while running:
        assert a.running == 1 or (a.reserved(POOL) <= POOL.blocks and a.running <= POOL.max_seqs)
        began += (more := a.finish(running.pop(rng.randrange(len(running))), POOL, 1.0))  # type: ignore[attr-defined]
        running += more
    assert a.running == a.waiting == 0
    assert began == [i for i in range(len(jobs)) if i not in leaving]


class FakeEngine:
    """The head's engine as the scheduler sees it: requests submitted, a token for each running one whenever the
    test calls :meth:`step`, and a cancelled one ended at once (as the engine's next event does)."""

    def __init__(self) -> None:
        self.blocks, self.config = BlockManager(64, 16), tick_budget(8)
        self.running: dict[int, tuple[Request, Callable[[Request], None]]] = {}

    def submit(self, request: Request, speculation: object, on_end: Callable[[Request], None]) -> None:
        self.running[request.index] = (request, on_end)
        request.on_cancel.append(self._cancel)

    def _cancel(self, request: Request) -> None:
        entry = self.running.pop(request.index, None)
        if entry is not None:
            request.end()
            entry[1](request)

    def step(self) -> None:
        for request, _ in list(self.running.values()):
            request.deliver(len(request.partial))


def test_scheduler_cancels_a_waiting_request_at_once_and_leaks_no_thread() -> None:
    """Over a scripted engine: a cancelled waiting request ends at once, a cancelled running one at the engine's
    next event, the queue's limit raises Busy with a Retry-After, and the scheduler starts no thread of its own."""
    engine = FakeEngine()
    head = SimpleNamespace(engine=engine, manifest=SimpleNamespace(runtime_hints=SimpleNamespace(max_positions=512)))
    before = threading.active_count()
    session = Scheduler(head, streams=1, max_queue=1)  # type: ignore[arg-type]
    config = SamplingConfig(max_tokens=3)
    running, waiting = session.submit([1], config), session.submit([1], config)
    with pytest.raises(Busy) as busy:
        session.submit([1], config)
    assert busy.value.retry_after >= 1 and "busy" in str(busy.value)
    waiting.cancel()
    assert waiting.done and waiting.partial == [] and (session.active, session.waiting) == (1, 0)
    engine.step()
    assert next(running.tokens()) == 0
    running.cancel()
    session.close()
    assert running.done and not engine.running and running.finish_reason == "cancelled"
    assert threading.active_count() == before
