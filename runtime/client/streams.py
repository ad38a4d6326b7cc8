"""A chain of stateful stages as a Link of the engine: every row of a tick is a Step on its sequence's own stream.

Stateful stages (``--kv stateful``, and families whose paged form is refused) keep one KV cache per stream and run
Steps, not Batches. :class:`StreamLink` lets the engine (scheduling/engine.py) drive them as it drives paged
stages, so the engine is the only way a head produces tokens::

    pool      STREAM_SLOTS blocks of max_positions positions: one block is one stream's whole cache, so the
              planner admits a sequence only while a stream slot is free; no prefix cache (a stream's cache is its
              own: the planner never admits a sequence on a cached prefix, every row starts at its position 0)
    send      each row of a tick as a p.Step on stream = the row's sequence id: Open before its first row, which
              waits (on no thread: held by the stream) until every stage acknowledged the Open; rewind = the stream's visible length - the row's position (the drafts the
              accept rule rejected); compact when the hidden positions would take the cache past max_positions
              (decoding/decode.py's CompactionPolicy); a row that wants no scores asks one argmax, read by nobody
    answers   each Step's Result is held until every Step of the tick is answered; then the engine is handed the
              wanted rows' Results tagged with the tick (their stream the sequence id) and a BatchDone with each
              stage's compute summed over the tick; a Step a stage refused (an Error) is the BatchDone's Refusal of
              that row, so the engine starts that request again alone; ticks are handed over in the order sent
    retire    a sequence the engine ended or started again: Close on every stage once its Steps in flight are
              answered (a stage must not drop a stream a Step of it is still on its way to)

A broken chain (a connection lost) reaches the engine as it does over paged stages: it reconnects through the head,
which wraps the new chain in a new StreamLink, and every request replays its history onto new streams.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.client.chain import Chain
from ovshard.runtime.engine.kv import CacheMask, CompactionPolicy
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.links import Deliver
from ovshard.runtime.wire import protocol as p

STREAM_SLOTS = 16  # sequences at once: under a stage's 32 streams a session, with room for streams still closing


@dataclass
class _Stream:
    mask: CacheMask = field(default_factory=CacheMask)  # a mirror of every stage's mask for this stream
    in_flight: int = 0  # its Steps not answered yet
    released: bool = False  # the engine is done with it: Close once nothing of it is in flight
    opening: list[p.Step] | None = field(default_factory=list)  # its Steps held until every stage opened it


@dataclass
class _Tick:
    rows: dict[int, tuple[int, bool]]  # a Step's step -> (its sequence, whether the engine wants its scores)
    results: list[p.Result] = field(default_factory=list)
    refused: list[p.Refusal] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


class StreamLink:
    """A stateful chain as the engine's Link (the module docstring)."""

    def __init__(self, chain: Chain, max_positions: int, slots: int = STREAM_SLOTS) -> None:
        self.chain, self.depth = chain, chain.depth
        self.blocks: BlockManager | None = BlockManager(slots, max_positions, prefix_cache=False)
        self.policy = CompactionPolicy(limit=max_positions)
        self.lock = threading.Lock()  # guards everything below: the engine's thread sends, readers answer
        self.streams: dict[int, _Stream] = {}
        self.ticks: dict[int, _Tick] = {}
        self.order: deque[int] = deque()  # ticks in the order sent, handed over in that order
        self.steps: dict[int, int] = {}  # a Step's step -> its tick
        self.step_numbers = itertools.count()
        self.deliver: Deliver | None = None

    def listen(self, deliver: Deliver) -> None:
        self.deliver = deliver
        self.chain.listen(self._on_message)

    def send_tick(self, batch: p.Batch) -> None:
        """Every row of ``batch`` as a Step on its sequence's stream; a new stream's Steps wait for its Open (the
        module docstring), the others go at once. Raises StageFailure."""
        ids = batch.tensor.to_array(np.int64)
        tick = _Tick({})
        steps: list[p.Step] = []
        new: list[int] = []
        start = 0
        with self.lock:
            for row in batch.rows:
                if row.stream not in self.streams:
                    self.streams[row.stream] = _Stream()
                    new.append(row.stream)
                stream = self.streams[row.stream]
                rewind = stream.mask.visible - row.position
                if rewind < 0:
                    raise StageFailure(f"sequence {row.stream}: a row at position {row.position}, but its stream "
                                       f"holds {stream.mask.visible} positions", recoverable=True)
                stream.mask.rewind(rewind)
                compact = self.policy.wants(stream.mask, row.count)
                if compact:
                    stream.mask.compact()
                stream.mask.append([1] * row.count)
                stream.in_flight += 1
                number = next(self.step_numbers)
                tick.rows[number] = (row.stream, bool(row.want))
                self.steps[number] = batch.tick
                tokens = p.Tensor.from_array(ids[None, start:start + row.count])  # [1, T]
                step = p.Step(row.stream, number, row.position, row.want or "argmax@1", tokens, {}, rewind, compact)
                if stream.opening is not None:
                    stream.opening.append(step)
                else:
                    steps.append(step)
                start += row.count
            self.ticks[batch.tick] = tick
            self.order.append(batch.tick)
        self._send(steps)
        for stream_id in new:
            self.chain.open_stream(stream_id, functools.partial(self._opened, stream_id))

    def _send(self, steps: list[p.Step]) -> None:
        for step in steps:
            try:
                self.chain.conns[0].send(step)
            except (OSError, OvshardError) as e:
                raise StageFailure(f"stage 0 at {self.chain.addresses[0]}: send failed: {e}", True) from e

    def _opened(self, stream_id: int, failure: StageFailure | None) -> None:
        """Every stage opened ``stream_id`` (or one failed: the chain is broken): its held Steps go now."""
        with self.lock:
            stream = self.streams.get(stream_id)
            held = (stream.opening or []) if stream is not None else []
            if stream is not None:
                stream.opening = None
        try:
            if failure is not None:
                raise failure
            self._send(held)
        except StageFailure as e:
            if self.deliver is not None:
                self.deliver(e)

    def retire(self, seq: int) -> None:
        """The engine is done with sequence ``seq``: its stream closes once none of its Steps is in flight."""
        with self.lock:
            stream = self.streams.get(seq)
            if stream is None:
                return
            stream.released = True
            closing = stream.in_flight == 0
            if closing:
                del self.streams[seq]
        if closing:
            self._close(seq)

    def _close(self, seq: int) -> None:
        for conn in self.chain.conns:
            try:
                conn.send(p.Close(seq))
            except (OSError, OvshardError):
                pass  # the connection is gone; so is the stream

    def _on_message(self, msg: p.Message | StageFailure) -> None:
        """A reader thread's answer: a Step's Result or Error counts towards its tick; a failure goes on."""
        if isinstance(msg, StageFailure):
            if self.deliver is not None:
                self.deliver(msg)
            return
        if not isinstance(msg, (p.Result, p.Error)) or msg.reply_to is None:
            return
        handed: list[p.Message] = []
        closing: list[int] = []
        with self.lock:
            tick_no = self.steps.pop(msg.reply_to, None)
            if tick_no is None:
                return
            tick = self.ticks[tick_no]
            seq, wanted = tick.rows.pop(msg.reply_to)
            if isinstance(msg, p.Error):
                tick.refused.append(p.Refusal(seq, 0, msg.code, msg.message))
            else:
                for stage, seconds in msg.timings.items():
                    tick.timings[stage] = tick.timings.get(stage, 0.0) + seconds
                if wanted:
                    tick.results.append(p.Result(seq, tick_no, msg.tensor, msg.timings, msg.indices))
            stream = self.streams.get(seq)
            if stream is not None:
                stream.in_flight -= 1
                if stream.released and stream.in_flight == 0:
                    del self.streams[seq]
                    closing.append(seq)
            while self.order and not self.ticks[self.order[0]].rows:
                done_no = self.order.popleft()
                done = self.ticks.pop(done_no)
                handed += [*done.results, p.BatchDone(done_no, done.timings, done.refused)]
        for seq in closing:
            self._close(seq)
        if self.deliver is not None:
            for message in handed:
                self.deliver(message)

    def close(self) -> None:
        self.chain.close()
