"""The tick planner of continuous batching: which sequences' rows go into each inference of a paged stage.

Pure bookkeeping over a block_tables.BlockManager (no OpenVINO, no sockets). A sequence is the token ids known so far
(prompt, sampled tokens, then the head's K draft tokens) and two counters::

    computed <= scheduled <= len(ids)    computed: positions whose KV is committed (BlockManager.computed)
    pending = len(ids) - scheduled        scheduled: positions computed or in a plan not finished yet
    tail = 1 + K                          the last rows, whose logits the head wants from one inference

Its work is a **prefill** while pending > tail (a prompt, or a preempted sequence's whole history), a
**decode** row when pending == tail == 1, **verify** rows when pending == tail == K + 1, and none while a plan
in flight wants its logits. A tick is one inference of at most B = token_budget rows, in three steps (vLLM's
and openvino-genai's "running first, then prompts", with chunked prefill)::

    1. decode/verify, oldest first: each running sequence whose pending rows are its tail gets them, its
       drafts cut to keep a row for each later one (and one for prefills): with max_seqs <= B every running
       sequence's next row fits. New slots come from BlockManager.append; on NoBlocks the newest running
       sequence is preempted and the append retried (the sequence preempts itself if it is the newest).
    2. prefill chunks, oldest first: min(pending, B_left, max_chunk) rows, ending before the tail unless the
       whole tail fits.
    3. admission, oldest first: a table for all known ids (BlockManager.allocate; prefix hits are computed
       already: the first row is at ``cached``) and a first chunk. The first sequence that finds no blocks
       (or a preempted one whose result is still in flight) ends the step: no newer one overtakes it.

**Preemption by recompute** frees the blocks (committed full ones stay in the prefix cache: a resume often hits
them) and sets scheduled = 0; the ids are kept and the sequence waits in arrival order. A sequence longer than
the pool is dropped. **Shared prefixes**: a waiting sequence sharing full prompt blocks with a running prefill
that has not committed them yet waits, then hits them: a prompt many requests bring at once is prefilled once.

**Pipelined ticks.** Plans may be made while earlier ones are in flight (stage k on tick i, stage k+1 on i-1)
and are finished in that order; a stage runs them in that order too, so a block freed or reused by tick i is
never read by an earlier tick afterwards. ``finish_tick`` commits positions (full blocks join the prefix cache),
rewinds rejected drafts by truncating the block table, appends the head's tokens and frees finished sequences;
rows of a sequence preempted or cancelled meanwhile commit nothing, but its sampled tokens are kept.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count

from ovshard.runtime.engine.paged import blocks_for
from ovshard.runtime.scheduling.block_tables import BlockKey, BlockManager, Granted, prefix_keys
from ovshard.runtime.scheduling.plan_types import (
    BatchError,
    PlannedRows,
    PlannerStats,
    Sampled,
    SeqView,
    TickBudget,
    TickPlan,
    Work,
)

# the scheduler's API: TickPlanner here, the values it takes and gives defined in batch_types.py
__all__ = ["TickBudget", "BatchError", "PlannerStats", "PlannedRows", "Sampled", "SeqView", "TickPlanner",
           "TickPlan", "Work"]

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    id: Hashable
    ids: list[int]
    arrival: int
    keys: list[BlockKey]  # the prompt's full-block keys (never its last id): shared prefills
    drafts: int = 0
    scheduled: int = 0
    admitted: bool = False
    awaiting: bool = False
    admission: int = -1
    preempted: bool = False
    last: PlannedRows | None = None  # rows whose logits went to a sampler that has not resumed yet
    cached: int = 0  # positions its latest admission found computed in the prefix cache

    @property
    def pending(self) -> int:
        return len(self.ids) - self.scheduled

    @property
    def tail(self) -> int:
        return 1 + self.drafts

    @property
    def ready(self) -> bool:
        return not self.awaiting and self.pending > 0

    @property
    def work(self) -> Work:
        return "none" if not self.ready else "prefill" if self.pending > self.tail else \
            "verify" if self.drafts else "decode"


@dataclass
class _Tick:
    budget: int
    seats: int  # sequences it may still take
    parts: list[PlannedRows] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Hashable] = field(default_factory=list)
    dropped: list[Hashable] = field(default_factory=list)


class TickPlanner:
    """Sequences, their block tables in ``blocks``, and the plan of each tick (the module docstring)."""

    def __init__(self, blocks: BlockManager, config: TickBudget | None = None) -> None:
        self.blocks, self.config = blocks, config or TickBudget()
        self._seqs: dict[Hashable, _Seq] = {}  # in arrival order
        self._flight: deque[int] = deque()
        self._admissions = count()  # numbers every admission: rows of an earlier one never commit into a later
        self._arrivals = self._next_tick = 0
        self._rows = self._seq_rows = self._last_rows = self._last_seqs = 0
        self._preemptions = self._dropped = 0

    def add(self, seq: Hashable, ids: Sequence[int], drafts: int = 0) -> None:
        """A new sequence with its prompt ``ids`` (its last ``drafts`` ids are drafts to verify: the first
        tick's logits cover them too); it waits for admission in arrival order."""
        size = self.blocks.block_size
        if seq in self._seqs:
            raise BatchError(f"sequence {seq!r} is already scheduled; cancel it first or use a new id")
        if not ids:
            raise BatchError(f"sequence {seq!r}: a prompt needs at least one token id, got none")
        if blocks_for(len(ids), size) > self.blocks.num_blocks:
            raise BatchError(f"sequence {seq!r}: {len(ids)} ids need {blocks_for(len(ids), size)} blocks of "
                             f"{size}, the pool has {self.blocks.num_blocks}: shorten the prompt or grow the pool")
        if not 0 <= drafts < len(ids):
            raise BatchError(f"sequence {seq!r}: {drafts} drafts in {len(ids)} ids; expected 0..{len(ids) - 1}")
        keys = prefix_keys(ids[:len(ids) - 1], size, self.blocks.root) if self.blocks.prefix_cache else []
        self._seqs[seq] = _Seq(seq, list(ids), self._arrivals, keys, drafts)
        self._arrivals += 1

    def cancel(self, seq: Hashable) -> None:
        """Forget ``seq`` now (a client went away); its rows in flight are ignored when they finish."""
        self._remove(self._get(seq))

    def view(self, seq: Hashable) -> SeqView:
        s = self._get(seq)
        return SeqView(s.id, tuple(s.ids), s.arrival, self.blocks.computed(s.id) if s.admitted else 0,
                       s.scheduled, s.drafts, s.work, s.admitted, s.awaiting, s.preempted, s.cached)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def __len__(self) -> int:
        """Sequences scheduled: running, in flight, waiting for their sampler or for admission."""
        return len(self._seqs)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The ticks planned and not finished yet, oldest first."""
        return tuple(self._flight)

    @property
    def stats(self) -> PlannerStats:
        running = sum(s.admitted for s in self._seqs.values())
        return PlannerStats(self._next_tick, self._rows, self._seq_rows, self._last_rows, self._last_seqs,
                          self._preemptions, self._dropped, running, len(self._seqs) - running, self.blocks.stats)

    @property
    def ready(self) -> int:
        """Sequences with rows to run now (running or waiting for admission)."""
        return sum(s.ready for s in self._seqs.values())

    def plan_tick(self, max_seqs: int | None = None) -> TickPlan:
        """The rows of the next inference (steps 1-3 of the module docstring), of at most ``max_seqs``
        sequences (oldest first: a pipeline splits its ready sequences over the ticks it can keep in flight)."""
        tick = _Tick(self.config.token_budget, max_seqs if max_seqs is not None else len(self._seqs))
        self._decode_step(tick)
        self._prefill_step(tick)
        self._admit_step(tick)
        plan = TickPlan(self._next_tick, tuple(tick.parts), tuple(tick.copies), tuple(tick.preempted),
                        tuple(tick.dropped))
        if plan.parts:
            self._flight.append(plan.tick)
            self._next_tick += 1
            self._last_rows, self._last_seqs = plan.rows, len(plan.parts)
            self._rows, self._seq_rows = self._rows + plan.rows, self._seq_rows + len(plan.parts)
        return plan

    def finish_tick(self, plan: TickPlan, results: Mapping[Hashable, Sampled]) -> tuple[SeqView, ...]:
        """The oldest plan in flight ran: ``results`` holds a Sampled for sequences it wanted logits of; one
        left out waits for :meth:`resume` (its sampler runs elsewhere, e.g. a stream's own thread).
        Returns the sequences that finished, as they ended."""
        if not plan.parts:
            return ()
        self._check_results(plan, results)
        self._flight.popleft()
        done = []
        for part in plan.parts:
            s = self._seqs.get(part.seq)
            if s is None:
                continue  # cancelled or dropped while its rows were in flight
            live = s.admitted and s.admission == part.admission
            if not part.want:
                if live:
                    self.blocks.commit(s.id, part.end)
                continue
            if part.seq not in results:
                if live:  # the fed rows before the drafts hold KV of kept ids whatever the sampler decides
                    self.blocks.commit(s.id, part.end - part.drafts)
                s.last = part
                continue
            sampled = results[part.seq]
            self._accept(s, part, sampled, live)
            if sampled.finished:
                done.append(self.view(s.id))
                self._remove(s)
        return tuple(done)

    def resume(self, seq: Hashable, sampled: Sampled) -> None:
        """What the head sampled from ``seq``'s rows of a finished tick left out of ``finish_tick``'s results."""
        s = self._get(seq)
        part = s.last
        if part is None or not s.awaiting:
            raise BatchError(f"sequence {seq!r} awaits no result: resume it once after finish_tick left it out")
        if not 0 <= sampled.accepted <= part.drafts or sampled.token < 0 or any(d < 0 for d in sampled.drafts):
            raise BatchError(f"sequence {seq!r} verified {part.drafts} drafts; expected 0..{part.drafts} accepted "
                             f"and token ids >= 0, found {sampled}")
        s.last = None
        self._accept(s, part, sampled, s.admitted and s.admission == part.admission)
        if sampled.finished:
            self._remove(s)

    def _decode_step(self, tick: _Tick) -> None:
        """Step 1: the tails of running sequences, oldest first; drafts cut to leave a row for each later one."""
        ready = [s for s in self._seqs.values() if s.admitted and s.ready and s.pending == s.tail]
        prefills = any(s.ready and (s.pending > s.tail or not s.admitted) for s in self._seqs.values())
        for i, s in enumerate(ready):
            if tick.seats < 1:
                return
            if not s.admitted:
                continue  # preempted this tick by an older sequence
            room = tick.budget - sum(later.admitted for later in ready[i + 1:])
            n = self._size(s, max(1, room - prefills)) if room >= 1 else 0
            if n and self._grow(s, tick):
                self._place(s, n, tick)

    def _prefill_step(self, tick: _Tick) -> None:
        """Step 2: the next chunk of each running prefill, oldest first, with the rows left."""
        for s in self._seqs.values():
            if tick.budget < 1 or tick.seats < 1:
                return
            if s.admitted and s.ready and s.pending > s.tail:
                self._place(s, self._size(s, tick.budget), tick)

    def _admit_step(self, tick: _Tick) -> None:
        """Step 3: waiting sequences, oldest first, while rows, sequence slots and blocks last."""
        running = sum(s.admitted for s in self._seqs.values())
        for s in list(self._seqs.values()):
            if tick.budget < 1 or tick.seats < 1 or running >= self.config.max_seqs:
                return
            if s.awaiting and not s.admitted:
                return  # a preempted sequence whose result is in flight resumes before any newer one
            if s.admitted or self._waits_for_shared_prefill(s):
                continue
            if blocks_for(len(s.ids), self.blocks.block_size) > self.blocks.num_blocks:
                log.warning("sequence %r dropped: its %d ids outgrew the pool", s.id, len(s.ids))
                del self._seqs[s.id]
                self._dropped += 1
                tick.dropped.append(s.id)
                continue
            granted = self.blocks.allocate(s.id, s.ids)
            if not isinstance(granted, Granted):
                return  # the oldest waiting sequence waits for blocks; no newer one overtakes it
            s.admitted, s.preempted, s.scheduled, s.admission = True, False, granted.cached, next(self._admissions)
            s.cached = granted.cached
            running += 1
            self._place(s, self._size(s, tick.budget), tick)

    def _size(self, s: _Seq, room: int) -> int:
        """Rows of ``s`` now with ``room`` rows left: its whole tail (drafts cut to fit), or a prefill chunk of
        at most ``max_chunk`` rows that ends before the tail unless it takes the tail whole."""
        if s.pending == s.tail:
            self._trim(s, min(s.drafts, room - 1))
            return s.pending
        n = min(s.pending, room, self.config.max_chunk or self.config.token_budget)
        return n if n == s.pending else min(n, s.pending - s.tail)

    def _trim(self, s: _Seq, keep: int) -> None:
        """Drop ``s``'s drafts past the first ``keep`` (proposals only: the head proposes again)."""
        cut = len(s.ids) - (s.drafts - keep)
        del s.ids[cut:]
        s.drafts = keep
        if s.admitted and self.blocks.length(s.id) > cut:
            self.blocks.truncate(s.id, cut)

    def _grow(self, s: _Seq, tick: _Tick) -> bool:
        """Slots for ``s``'s known ids; on NoBlocks preempt the newest running sequence and retry.
        False when ``s`` itself was the newest and was preempted."""
        while True:
            missing = s.ids[self.blocks.length(s.id):]
            if not missing:
                return True
            result = self.blocks.append(s.id, missing)
            if isinstance(result, Granted):
                tick.copies.extend(result.copies)
                return True
            victim = next(v for v in reversed(self._seqs.values()) if v.admitted)
            self._preempt(victim, tick)
            if victim is s:
                return False

    def _place(self, s: _Seq, n: int, tick: _Tick) -> None:
        start, end = s.scheduled, s.scheduled + n
        want = s.tail if end == len(s.ids) else 0
        tick.parts.append(PlannedRows(s.id, start, tuple(s.ids[start:end]), self.blocks.blocks(s.id), want,
                                     s.admission))
        s.scheduled, s.awaiting = end, want > 0
        tick.budget -= n
        tick.seats -= 1

    def _preempt(self, s: _Seq, tick: _Tick) -> None:
        """Preemption by recompute: free the blocks, keep the ids, prefill again from scratch when admitted."""
        self.blocks.free(s.id)
        s.admitted, s.preempted, s.scheduled = False, True, 0
        self._preemptions += 1
        tick.preempted.append(s.id)
        log.debug("preempted sequence %r (%d ids) to recompute later: the pool is full", s.id, len(s.ids))

    def _waits_for_shared_prefill(self, s: _Seq) -> bool:
        """Whether a running sequence shares full prompt blocks with ``s`` that it has not committed yet."""
        if not (self.config.defer_shared_prefills and s.keys):
            return False
        for other in self._seqs.values():
            if other.admitted and other is not s:
                shared = next((i for i, (a, b) in enumerate(zip(s.keys, other.keys, strict=False)) if a != b),
                              min(len(s.keys), len(other.keys)))
                if self.blocks.computed(other.id) < shared * self.blocks.block_size:
                    return True
        return False

    def _accept(self, s: _Seq, part: PlannedRows, sampled: Sampled, live: bool) -> None:
        """Keep the verified rows, forget the rejected drafts, append the head's tokens. With K drafts in the
        rows' last K ids and a accepted, positions [0, end - K + a) hold KV of kept ids: the rest is rewound
        by truncating the block table (exact: attention reads past_lens positions only)."""
        valid = part.end - (part.drafts - sampled.accepted)
        if live:
            if valid < part.end:
                self.blocks.truncate(s.id, valid)
            self.blocks.commit(s.id, valid)
            s.scheduled = valid
        del s.ids[valid:]
        s.ids += [sampled.token, *sampled.drafts]
        s.drafts, s.awaiting = len(sampled.drafts), False

    def _check_results(self, plan: TickPlan, results: Mapping[Hashable, Sampled]) -> None:
        if not self._flight or self._flight[0] != plan.tick:
            raise BatchError(f"plans finish in the order they were made: expected tick {(self._flight or [None])[0]}, "
                             f"got tick {plan.tick}; finish the oldest plan in flight first")
        wanted = {part.seq: part for part in plan.parts if part.want}
        extra = [seq for seq in results if seq not in wanted]
        if extra:
            raise BatchError(f"tick {plan.tick} wanted logits of {sorted(map(repr, wanted))}; results hold "
                             f"{extra} besides: give at most one Sampled per sequence with want > 0")
        for seq, sampled in results.items():
            drafts = wanted[seq].drafts
            if not 0 <= sampled.accepted <= drafts or sampled.token < 0 or any(d < 0 for d in sampled.drafts):
                raise BatchError(f"sequence {seq!r} of tick {plan.tick} verified {drafts} drafts; expected "
                                 f"0..{drafts} accepted and token ids >= 0, found accepted {sampled.accepted}, "
                                 f"token {sampled.token}, drafts {sampled.drafts}")

    def _get(self, seq: Hashable) -> _Seq:
        s = self._seqs.get(seq)
        if s is None:
            raise BatchError(f"sequence {seq!r} is not scheduled (never added, finished, cancelled or dropped)")
        return s

    def _remove(self, s: _Seq) -> None:
        if s.admitted:
            self.blocks.free(s.id)
        del self._seqs[s.id]
