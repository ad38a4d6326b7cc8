"""Continuous batching at the head: the steps of every stream over one chain of paged stages, as Batches.

Each stream's decode loop (decoding/decode.py) runs on its own thread and calls :meth:`PagedTarget.step` as
it would on the stateful path; the :class:`Batcher` collects what every stream asked for in one scheduler
(engine/batching.py, which owns the block tables of the session's grant on every stage) and sends one Batch
per tick to stage 0. It keeps one tick in flight per stage, so stage k computes tick i while stage k+1
computes tick i-1; a stream joins at the next tick after it asks and leaves when its loop ends. A prompt
longer than a tick's budget is prefilled in chunks over consecutive ticks, pipelined across the stages.

What the scheduler sees of a stream's step (K drafts asked, ``rewind`` of the previous K rejected)::

    first step     add(stream, tokens, drafts=K)
    later steps    resume(stream, Sampled(token=tokens[0], accepted=K_prev - rewind, drafts=tokens[1:]))

so a rewind is a shorter block table (exact), never a mask. **Micro-batches**: with d ticks in flight at most (d
the stage count), a tick takes at most ceil(S / d) of the S sequences scheduled, oldest first, so d groups of
equal size keep every stage busy (2 streams on 2 stages go one a tick, as two pipelined streams would; a group
that came back larger than its share is split at once, never left to ride alone); and a free slot waits up to
COALESCE_S for every stream of the group a tick answered to ask again, so a group goes out together instead
of its first stream alone. A stream whose rows a stage refused, or whose
chain broke, starts again as a new sequence with its whole history (the prefix cache usually holds most of
it): the replay of the stateful path.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from ovshard.errors import OvshardError
from ovshard.runtime.engine.batching import BatchConfig, BatchStats, Sampled, StageScheduler, TickPlan
from ovshard.runtime.engine.blocks import BlockManager
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.wire import protocol as p

log = logging.getLogger(__name__)

MAX_DRAFTS = 16  # drafts one step may verify: the budget leaves a whole tail for every sequence
COALESCE_S = 0.002  # how long a free pipeline slot waits for the rest of a group that was answered together


class BatchFailure(OvshardError):
    """A tick or a row failed; ``recoverable``: the stream starts again (on a new chain if the old broke)."""

    def __init__(self, message: str, recoverable: bool) -> None:
        super().__init__(message)
        self.recoverable = recoverable


def batch_config(max_seqs: int, token_budget: int | None = None, max_chunk: int | None = None) -> BatchConfig:
    """The head's scheduler settings: a budget that always holds every sequence's whole tail (so drafts
    are never cut: a stream gets the rows it asked for)."""
    budget = max(token_budget or 0, max_seqs * (1 + MAX_DRAFTS))
    return BatchConfig(token_budget=budget, max_seqs=max_seqs, max_chunk=max_chunk)


@dataclass
class _Flight:
    seq: int
    plan: TickPlan
    sent: float


class Batcher:
    """One chain's scheduler and its ticks in flight. ``send(message)`` hands a Batch to stage 0;
    :meth:`takes` takes the last stage's answers (the chain's reader thread calls it)."""

    def __init__(self, send: Callable[[p.Batch], None], blocks: BlockManager, config: BatchConfig, depth: int,
                 timeout: float) -> None:
        self.send, self.depth, self.timeout = send, depth, timeout
        self.scheduler = StageScheduler(blocks, config)
        self.cond = threading.Condition()
        self.boxes: dict[int, queue.Queue] = {}  # stream -> where its next Scores go
        self.drafts: dict[int, int] = {}  # drafts of each stream's last request
        self.wants: dict[int, str] = {}  # and what it wants of the last stage
        self.flight: deque[_Flight] = deque()
        self.answers: dict[int, dict[int, p.Result]] = {}
        self.expected: set[int] = set()  # streams answered that have not asked again yet
        self.answered_at = 0.0
        self.broken: BatchFailure | None = None
        self.closed = False
        self.seqs = itertools.count()
        self.tick_s: list[float] = []
        threading.Thread(target=self._run, name="batcher", daemon=True).start()

    # ----- streams (any thread) -----
    def step(self, stream: int, tokens: list[int], want: str, rewind: int, fresh: bool) -> Scores:
        """The Scores of ``stream``'s next step: ``fresh`` starts the sequence with ``tokens``."""
        box: queue.Queue = queue.Queue(1)
        drafts = p.rows_read(want, len(tokens)) - 1
        if not 0 <= drafts <= MAX_DRAFTS:
            raise OvshardError(f"a batched step verifies at most {MAX_DRAFTS} drafts, asked {drafts}")
        with self.cond:
            if self.broken is not None:
                raise self.broken
            if fresh:
                self.scheduler.add(stream, tokens, drafts)
            else:
                accepted = self.drafts[stream] - rewind
                self.scheduler.resume(stream, Sampled(tokens[0], accepted, tuple(tokens[1:])))
            self.drafts[stream], self.wants[stream] = drafts, want
            self.boxes[stream] = box
            self.expected.discard(stream)
            self.cond.notify_all()
        try:
            got = box.get(timeout=self.timeout)
        except queue.Empty:
            raise OvshardError(f"no answer to stream {stream}'s step within {self.timeout:.0f} s") from None
        if isinstance(got, Exception):
            raise got
        return got

    def leave(self, stream: int) -> None:
        """``stream`` is done: its blocks go back (its full blocks stay in the prefix cache)."""
        with self.cond:
            if stream in self.scheduler:
                self.scheduler.cancel(stream)
            self.boxes.pop(stream, None)
            self.drafts.pop(stream, None)
            self.wants.pop(stream, None)
            self.expected.discard(stream)
            self.cond.notify_all()

    def cached(self, stream: int) -> int:
        """Positions of ``stream`` its admission found computed in the prefix cache."""
        with self.cond:
            return self.scheduler.view(stream).cached if stream in self.scheduler else 0

    @property
    def stats(self) -> BatchStats:
        with self.cond:
            return self.scheduler.stats

    # ----- the chain's reader thread -----
    def takes(self, msg: p.Message) -> bool:
        """Whether ``msg`` answers a tick in flight (then it was taken)."""
        if isinstance(msg, p.Result):
            with self.cond:
                if msg.seq in self.answers:
                    self.answers[msg.seq][msg.stream] = msg
                    return True
            return False
        if isinstance(msg, p.BatchDone):
            self._finish(msg)
            return True
        if isinstance(msg, p.Error) and msg.seq is not None:
            with self.cond:
                ours = msg.seq in self.answers
            if ours:
                self.fail(BatchFailure(f"a stage failed tick {msg.seq}: {msg.code}: {msg.message}",
                                       msg.code in p.RECOVERABLE_CODES or msg.code in ("failed", "internal")))
            return ours
        return False

    def fail(self, failure: BatchFailure) -> None:
        """The chain broke: every waiting stream gets ``failure``; nothing more is sent on it."""
        with self.cond:
            if self.broken is None:
                self.broken = failure
            for box in self.boxes.values():
                box.put(failure)
            self.boxes.clear()
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _finish(self, done: p.BatchDone) -> None:
        with self.cond:
            if not self.flight or self.flight[0].seq != done.seq:
                log.warning("tick %d finished out of order; ignored", done.seq)
                return
            flight = self.flight.popleft()
            answers = self.answers.pop(done.seq, {})
            self.tick_s.append(time.perf_counter() - flight.sent)
            refused = {r.stream: r for r in done.refused}
            for stream, refusal in refused.items():  # it must start again: none of its rows may commit
                self._drop(stream, BatchFailure(f"stage {refusal.stage} refused stream {stream}: "
                                                f"{refusal.message}", recoverable=True))
            self.scheduler.finish_tick(flight.plan, {})
            for rows in flight.plan.seqs:
                stream = cast(int, rows.seq)
                if rows.want and stream not in refused and stream in self.boxes:
                    self._answer(stream, answers.get(stream), done.timings)
            self.cond.notify_all()

    def _answer(self, stream: int, result: p.Result | None, timings: dict[str, float]) -> None:
        box = self.boxes.pop(stream)
        self.expected.add(stream)
        self.answered_at = time.perf_counter()
        if result is None:
            box.put(BatchFailure(f"the last stage sent no scores for stream {stream}", recoverable=True))
            return
        indices = None if result.indices is None else result.indices.to_array()[0]
        box.put(Scores(result.tensor.to_array()[0], indices, dict(timings)))

    def _drop(self, stream: int, failure: BatchFailure) -> None:
        if stream in self.scheduler:
            self.scheduler.cancel(stream)
        waiting = self.boxes.pop(stream, None)
        if waiting is not None:
            waiting.put(failure)

    # ----- the batcher's own thread -----
    def _run(self) -> None:
        while True:
            with self.cond:
                plan = None
                while not self.closed and self.broken is None:
                    if len(self.flight) < self.depth and self._gathered():
                        # a group's share of every sequence scheduled, not of those ready now: a tick of
                        # all that are ready while the other group is out would keep the groups unequal
                        plan = self.scheduler.plan_tick(max(1, -(-len(self.scheduler) // self.depth)))
                        for stream in plan.dropped:
                            pool = self.scheduler.blocks.num_blocks
                            self._drop(cast(int, stream), BatchFailure(f"stream {stream} outgrew the KV pool of every "
                                                                       f"stage ({pool} blocks)", False))
                        if plan.seqs:
                            break
                    self.cond.wait(COALESCE_S if self.expected else None)
                if plan is None or not plan.seqs:
                    return
                seq = next(self.seqs)
                message = self._message(seq, plan)
                self.flight.append(_Flight(seq, plan, time.perf_counter()))
                self.answers[seq] = {}
            try:
                self.send(message)
            except OvshardError as e:
                self.fail(BatchFailure(f"stage 0: {e}", recoverable=True))
                return

    def _gathered(self) -> bool:
        """Whether the streams answered by the latest tick have asked again (or left), or COALESCE_S passed:
        a group that came back together goes out together, instead of its first stream alone."""
        if not self.expected:
            return True
        if time.perf_counter() - self.answered_at >= COALESCE_S:
            self.expected.clear()
            return True
        return False

    def _message(self, seq: int, plan: TickPlan) -> p.Batch:
        size = self.scheduler.blocks.block_size
        rows: list[p.BatchRow] = []
        tables: list[int] = []
        ids: list[int] = []
        for planned in plan.seqs:
            table = planned.blocks[:-(-planned.end // size)]
            stream = cast(int, planned.seq)
            want = self.wants[stream] if planned.want else ""
            rows.append(p.BatchRow(stream, planned.position, planned.count, want, len(table)))
            tables.extend(table)
            ids.extend(planned.ids)
        copies = None if not plan.copies else p.Tensor.from_array(np.array(plan.copies, dtype=np.int32))
        return p.Batch(seq, rows, p.Tensor.from_array(np.array(ids, dtype=np.int64)),
                       p.Tensor.from_array(np.array(tables, dtype=np.int32)), copies)
