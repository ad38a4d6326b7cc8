"""The engine: one loop per chain of stages that schedules, sends ticks, and advances every request.

A chain of workers over paged stages runs a tick as one Batch; over stateful ones each row is a Step on its
sequence's own stream (client/streams.py's Link); stages in this process run it on the engine's thread, no socket
(client/local_head.py's Link). Every token ovshard produces comes from this loop.

One thread runs it, its own, or (``background=False``) the caller's, one turn each :meth:`Engine.step`: the way
the stages in this process are driven by the reader of their one request, with no thread to hand a token to (as
vLLM's in-process engine client steps its core). Requests are state machines (requests.py), not threads. Each
turn of the loop::

    events   submissions, cancels, readers asking for more, the last stage's answers, a broken chain
    update   for each answered tick, oldest first: the accept rule over every row (runs.accept_rows), each
             request's tokens delivered and its next drafts proposed (runs.Run.take), then the planner's
             finish_tick with every Sampled at once (a paced request's is held while its reader has not read
             the tokens of its row before: its next row is computed while the reader takes the last one)
    plan     while fewer than ``depth`` (the stage count) ticks are in flight and rows are ready: plan a tick
             of at most ceil(S / depth) of the S sequences scheduled (d equal groups keep every stage busy)
             and send it to stage 0; no waiting for anyone

A cancelled request leaves at the next event (its blocks freed at once; its rows in flight are ignored). A tick
that fails or a chain that breaks sends every request to *replaying*: the engine reconnects through its host
(``Head.reconnect``: once, with backoff, within ``retry_s``; on a thread of its own, so that submissions and
cancels are handled meanwhile) and starts each again as a new sequence holding its whole history, so a greedy
request finishes with the tokens of an uninterrupted run. A row a stage refused does the same for that request
alone, on the same chain.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.links import Host, Link, Scored
from ovshard.runtime.scheduling.plan_types import BatchError, PlannerStats, Sampled, TickBudget, TickPlan
from ovshard.runtime.scheduling.requests import Phase, Request
from ovshard.runtime.scheduling.runs import Run, accept_rows
from ovshard.runtime.scheduling.tick_planner import TickPlanner
from ovshard.runtime.scheduling.ticks import tick_message
from ovshard.runtime.wire import protocol as p

log = logging.getLogger(__name__)



@dataclass
class _Submit:
    request: Request
    speculation: Speculation | None
    on_end: Callable[[Request], None] | None


@dataclass
class _Cancel:
    request: Request


@dataclass
class _Read:
    request: Request


@dataclass
class _Answer:
    link: int  # which chain it came from: answers of a stale one are dropped
    message: p.Message | Scored | StageFailure


class _Close:
    pass


@dataclass
class _Reconnected:
    outcome: Link | OvshardError  # the new chain, or why there is none


@dataclass
class _Flight:
    plan: TickPlan
    sent: float


class Engine:
    """The loop over one chain at a time (the module docstring). ``send`` is called with every tick's Batch."""

    def __init__(self, host: Host, link: Link, config: TickBudget, max_positions: int, vocab_size: int,
                 retry_s: float, timeout: float, background: bool = True) -> None:
        self.host, self.config, self.max_positions, self.vocab_size = host, config, max_positions, vocab_size
        self.retry_s, self.timeout = retry_s, timeout
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.runs: dict[int, Run] = {}  # by request index, in submission order
        self.by_seq: dict[int, Run] = {}
        self.ends: dict[int, Callable[[Request], None]] = {}
        self.seq_ids = itertools.count()  # a new sequence id for every (re)start
        self.links = itertools.count()
        self.broken: StageFailure | None = None
        self.reconnecting = False  # a thread is asking the host for a new chain
        self.closed = False
        self._closing = threading.Lock()  # a reconnect that ends after the loop closed closes its chain itself
        self._attach(link)
        self._stats = self.planner.stats
        self.send: Callable[[p.Batch], None] = lambda batch: self.link.send_tick(batch)
        self.thread: threading.Thread | None = None  # None: the caller turns the loop (step)
        if background:
            self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self.thread.start()

    # ----- any thread -----
    def submit(self, request: Request, speculation: Speculation | None = None,
               on_end: Callable[[Request], None] | None = None) -> None:
        """Run ``request``; ``on_end(request)`` once it has ended (whatever the reason)."""
        request.on_cancel.append(lambda r: self.inbox.put(_Cancel(r)))
        if request.paced:
            request.on_read = lambda r: self.inbox.put(_Read(r))
        self.inbox.put(_Submit(request, speculation, on_end))

    @property
    def stats(self) -> PlannerStats:
        """The planner's counters as of the loop's latest turn (since the latest (re)connect)."""
        return self._stats

    @property
    def blocks(self) -> BlockManager:
        return self.planner.blocks

    def close(self) -> None:
        """Stop the loop; requests still running end with an error."""
        self.inbox.put(_Close())
        if self.thread is None:
            self.step()
        elif threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)

    def step(self) -> bool:
        """One turn of the loop on the caller's thread, waiting for nothing (an engine made with
        ``background=False``): the ticks that can be sent (a link in this process answers them before it returns),
        then every event waiting, those answers included. False once the engine closed."""
        assert self.thread is None, "an engine with a thread of its own turns by itself"
        return not self.closed and self._turn(block=False)

    # ----- the loop's thread -----
    def _loop(self) -> None:
        while self._turn(block=True):
            pass

    def _turn(self, block: bool) -> bool:
        """Recover or send what can be sent, then handle the events (``block``: waiting for the first, at most
        until the oldest tick in flight times out); False once closed."""
        try:
            if self.broken is not None and self.runs and not self.reconnecting:
                self._recover()
            if self.broken is None:
                self._fill()
            wait: float | None = 0.0
            if block and not (self.broken is not None and self.runs and not self.reconnecting):
                wait = max(0.0, self.flight[0].sent + self.timeout - time.perf_counter()) if self.flight else None
            try:
                event = self.inbox.get(timeout=wait) if wait != 0.0 else self.inbox.get_nowait()
            except queue.Empty:
                event = None
            while event is not None:
                if isinstance(event, _Close):
                    with self._closing:
                        self.closed = True
                    self._end_all(OvshardError("the head closed"))
                    return False
                self._handle(event)
                event = None if self.inbox.empty() else self.inbox.get()
            if self.flight and time.perf_counter() - self.flight[0].sent > self.timeout:
                self._break(StageFailure(f"no answer to tick {self.flight[0].plan.tick} within "
                                         f"{self.timeout:.0f} s", recoverable=True))
        except Exception as e:  # never let the loop die silently: every request carries what went wrong
            log.exception("the engine loop failed")
            self._end_all(OvshardError(f"the engine failed: {type(e).__name__}: {e}"))
            self.broken = self.broken or StageFailure(str(e), recoverable=True)
        self._stats = self.planner.stats
        return True

    def _handle(self, event: object) -> None:
        if isinstance(event, _Submit):
            self._start(event)
        elif isinstance(event, _Cancel):
            run = self.runs.get(event.request.index)
            if run is not None:
                self._end(run)
        elif isinstance(event, _Read):
            run = self.runs.get(event.request.index)
            if run is not None and run.parked is not None and run.seq in self.planner:
                sampled, run.parked = run.parked, None
                run.step_start = time.perf_counter()
                self.planner.resume(run.seq, sampled)
        elif isinstance(event, _Answer) and event.link == self.link_id:
            self._answer(event.message)
        elif isinstance(event, _Reconnected):
            self._reconnected(event.outcome)

    def _start(self, event: _Submit) -> None:
        request = event.request
        run = Run(request, event.speculation, self.max_positions)
        self.runs[request.index] = run
        if event.on_end is not None:
            self.ends[request.index] = event.on_end
        request.started = request.started or time.perf_counter()
        why = run.prompt_error()
        if request.cancelled or why:
            self._end(run, OvshardError(why) if why else None)
            return
        run.propose()
        if self.broken is None:
            self._add(run)  # else it starts once the chain is back (_reconnected)

    def _add(self, run: Run) -> None:
        """``run`` as a new sequence of the planner, holding its whole history and its drafts."""
        run.seq = next(self.seq_ids)
        run.parked = None
        try:
            self.planner.add(run.seq, run.ids, len(run.drafts))
        except BatchError as e:
            self._end(run, OvshardError(str(e)))
            return
        self.by_seq[run.seq] = run

    def _answer(self, msg: p.Message | Scored | StageFailure) -> None:
        if isinstance(msg, StageFailure):
            self._break(msg)
        elif isinstance(msg, Scored) and msg.tick in self.answers:
            self.answers[msg.tick][msg.seq] = msg.scores
        elif isinstance(msg, p.Result) and msg.reply_to in self.answers:
            self.answers[msg.reply_to][msg.stream] = _scores(msg)
        elif isinstance(msg, p.BatchDone):
            self._finish_tick(msg)
        elif isinstance(msg, p.Error) and msg.reply_to in self.answers:
            self._break(StageFailure(f"a stage failed tick {msg.reply_to}: {msg.code}: {msg.message}",
                                     msg.code in p.RECOVERABLE_CODES or msg.code in ("failed", "internal")))

    def _finish_tick(self, done: p.BatchDone) -> None:
        """The oldest tick in flight was answered: accept every row, then tell the planner."""
        if not self.flight or self.flight[0].plan.tick != done.tick:
            log.warning("tick %d finished out of order; ignored", done.tick)
            return
        plan = self.flight.popleft().plan
        answers = self.answers.pop(done.tick, {})
        refused = {r.stream: r.message for r in done.refused}
        for part in plan.parts:
            if part.want and part.seq in self.by_seq and part.seq not in refused and part.seq not in answers:
                refused[int(part.seq)] = "the last stage sent no scores for it"
        again = [(seq, self.by_seq.pop(seq)) for seq in refused if seq in self.by_seq]
        for _, run in again:
            self.planner.cancel(run.seq)  # none of its rows may commit: it starts again
            self.link.retire(run.seq)
        answered = [(part, self.by_seq[part.seq]) for part in plan.parts if part.want and part.seq in self.by_seq]
        runs = [run for _, run in answered]
        scores = [replace(answers[part.seq], timings=dict(done.timings))  # type: ignore[index]
                  for part, _ in answered]
        verified = [part.drafts for part, _ in answered]
        results: dict[Hashable, Sampled] = {}
        finished: list[Run] = []
        for run, new, n in zip(runs, accept_rows(runs, verified, scores, self.vocab_size), verified, strict=True):
            if not run.emitted:  # its first answer: the prompt positions its admission found computed
                run.request.stats.cached_tokens = self.planner.view(run.seq).cached
            run.request.move(Phase.DECODING)
            behind = run.request.paced and run.request.unread  # its reader has not read the last row's tokens
            sampled = run.take(new, n, done.timings)
            if sampled.finished:
                finished.append(run)
            if behind and not sampled.finished:
                run.parked = sampled  # the next row waits for the reader: it runs at most one row ahead
            else:
                results[run.seq] = sampled
        self.planner.finish_tick(plan, results)
        for run in finished:
            self.by_seq.pop(run.seq, None)
            self._end(run)
        for seq, run in again:
            self._replay(run, StageFailure(f"sequence {seq}: {refused[seq]}", recoverable=True))

    def _fill(self) -> None:
        """Plan and send ticks while a pipeline slot is free and rows are ready."""
        while len(self.flight) < self.depth:
            plan = self.planner.plan_tick(max(1, -(-len(self.planner) // self.depth)))
            for seq in plan.preempted:
                if seq in self.by_seq:
                    self.by_seq[seq].request.move(Phase.PREEMPTED)
            for seq in plan.dropped:
                run = self.by_seq.pop(seq, None)  # type: ignore[call-overload]
                if run is not None:
                    self._end(run, OvshardError(f"request {run.request.index} outgrew the KV pool of every stage "
                                                f"({self.planner.blocks.num_blocks} blocks)"))
            if not plan.parts:
                return
            wants = {}
            for part in plan.parts:
                run = self.by_seq[part.seq]  # type: ignore[index]
                if run.request.phase is not Phase.DECODING:
                    run.request.move(Phase.PREFILLING)
                if part.want:
                    wants[part.seq] = run.want(part.want)
            message = tick_message(plan, wants, self.planner.blocks.block_size)
            self.flight.append(_Flight(plan, time.perf_counter()))
            self.answers[plan.tick] = {}
            try:
                self.send(message)
            except StageFailure as e:
                self._break(e)
                return

    # ----- failures -----
    def _break(self, failure: StageFailure) -> None:
        """The chain failed: nothing more is sent on it; the loop recovers before it plans again."""
        if self.broken is None:
            log.warning("%s; every request starts again", failure)
            self.broken = failure
        self.link_id = -1  # answers still on their way from the broken chain are dropped
        self.flight.clear()
        self.answers.clear()

    def _recover(self) -> None:
        """Reconnect (through the host, on a thread: :meth:`_reconnect`); :meth:`_reconnected` starts every
        request again as a new sequence."""
        failure = self.broken
        assert failure is not None
        now = time.monotonic()
        for run in list(self.runs.values()):
            run.deadline = run.deadline or now + self.retry_s
            if run.seq >= 0:  # not one that came after the break, which has nothing to replay yet
                run.request.move(Phase.REPLAYING)
            if not failure.recoverable or self.host.expired(run.deadline):
                self._end(run, failure if not failure.recoverable else
                          OvshardError(f"{failure}; gave up after {self.retry_s:.0f} s (--retry-s)"))
        if not self.runs:
            return
        deadline = max(run.deadline or now for run in self.runs.values())
        self.reconnecting = True
        stale = self.link
        threading.Thread(target=self._reconnect, args=(stale, deadline, failure), name="engine-reconnect",
                         daemon=True).start()

    def _reconnect(self, stale: Link, deadline: float, failure: StageFailure) -> None:
        """On a thread of its own, so that submissions and cancels go on meanwhile: a new chain from the host."""
        outcome: Link | OvshardError
        try:
            outcome = self.host.reconnect(stale, deadline, failure)
        except OvshardError as e:
            outcome = e
        with self._closing:
            if not self.closed:
                self.inbox.put(_Reconnected(outcome))
                return
        if not isinstance(outcome, OvshardError):
            outcome.close()

    def _reconnected(self, outcome: Link | OvshardError) -> None:
        """The host answered: serve from the new chain, every request starting again on it (those that came
        meanwhile for the first time), or end them all with why there is none."""
        self.reconnecting = False
        if isinstance(outcome, OvshardError):
            self._end_all(outcome)
            return
        self._attach(outcome)
        for run in list(self.runs.values()):
            if run.seq < 0:
                self._add(run)
            else:
                self._restart(run)

    def _replay(self, run: Run, cause: StageFailure) -> None:
        """``run`` starts again on this chain (a stage refused its rows), within its retry window."""
        run.deadline = run.deadline or time.monotonic() + self.retry_s
        if self.host.expired(run.deadline):
            self._end(run, OvshardError(f"{cause}; gave up after {self.retry_s:.0f} s (--retry-s)"))
            return
        log.warning("request %d: %s; starting it again with its %d tokens", run.request.index, cause, len(run.ids))
        run.request.move(Phase.REPLAYING)
        self._restart(run)

    def _restart(self, run: Run) -> None:
        self.host.count_replay(len(run.history) - 1 if run.emitted else 0)
        run.request.stats.replays += 1
        run.step_start = time.perf_counter()
        self._add(run)

    def _attach(self, link: Link) -> None:
        """Serve from ``link``: a planner over its blocks, nothing in flight."""
        assert link.blocks is not None, "an engine runs over a chain with a pool to plan in"
        self.link, self.link_id, self.depth = link, next(self.links), link.depth
        self.planner = TickPlanner(link.blocks, self.config)
        self.flight: deque[_Flight] = deque()
        self.answers: dict[int, dict[int, Scores]] = {}  # by tick, then sequence
        self.by_seq.clear()
        self.broken = None
        link_id = self.link_id
        link.listen(lambda message: self.inbox.put(_Answer(link_id, message)))

    # ----- ends -----
    def _end(self, run: Run, error: Exception | None = None) -> None:
        """``run``'s request is over: its blocks go back now, its reader and its submitter are told."""
        request = run.request
        self.runs.pop(request.index, None)
        if self.by_seq.get(run.seq) is run:
            del self.by_seq[run.seq]
        if run.seq in self.planner:
            self.planner.cancel(run.seq)
        if run.seq >= 0 and self.broken is None:  # a broken chain's sequences went with it
            self.link.retire(run.seq)
        request.stats.total_s = time.perf_counter() - run.start
        request.end(error)
        on_end = self.ends.pop(request.index, None)
        if on_end is not None:
            on_end(request)

    def _end_all(self, error: Exception) -> None:
        for run in list(self.runs.values()):
            self._end(run, error)


def _scores(result: p.Result) -> Scores:
    """A row's answer as the accept rule reads it: argmax ids [R], top-k [R, K] or logits [R, V]."""
    indices = None if result.indices is None else result.indices.to_array()[0]
    return Scores(result.tensor.to_array()[0], indices)
