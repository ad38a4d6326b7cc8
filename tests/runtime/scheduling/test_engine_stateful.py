"""The engine loop on its stateful backend (one stream a request) without sockets: scripted streams answer each
step in process (scripted_chain.py has the paged chain's doubles this shares)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scripted_chain import (
    MAX_POSITIONS,
    NEXT,
    VOCAB,
    HeldAnswers,
    OffByOne,
    ScriptedHost,
    run,
    settle,
    solo,
)

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.client.streams import StreamLink
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.scheduling.engine import Engine
from ovshard.runtime.scheduling.ticks import tick_budget
from ovshard.runtime.wire import protocol as p


class ScriptedStreams(HeldAnswers):
    """A chain of stateful stages in process, as a StreamLink sees it (``conns[0]``, ``open_stream``,
    ``listen``): it keeps each open stream's cache as a stage does and refuses what a stage refuses
    (node/steps.check_step: the position after the rewind, the physical cache past max_positions without
    compact), answers each Step's rows by ``NEXT``; ``hold`` keeps answers, ``refuse_step`` / ``fail_step``
    script a stage's Error on the n-th Step and a lost connection."""

    def __init__(self, max_positions: int = MAX_POSITIONS, hold: bool = False) -> None:
        super().__init__(hold)
        self.depth, self.addresses, self.conns = 2, ["scripted:0", "scripted:1"], [self]
        self.max_positions = max_positions
        self.caches: dict[int, list[int]] = {}  # stream -> its mask (1 visible, 0 hidden)
        self.steps: list[p.Step] = []
        self.opened: list[int] = []
        self.closed_streams: list[int] = []
        self.refuse_step: int | None = None
        self.fail_step: int | None = None
        self.max_open = 0
        self.hold_opens = False  # every stage's OpenOk held until the test calls self.opening's callbacks
        self.opening: list[Callable[[], None]] = []

    def open_stream(self, stream: int, opened: Callable[[StageFailure | None], None]) -> None:
        assert stream not in self.caches
        self.caches[stream] = []
        self.opened.append(stream)
        self.max_open = max(self.max_open, len(self.caches))
        if self.hold_opens:
            self.opening.append(lambda: opened(None))
        else:
            opened(None)

    def send(self, msg: p.Message) -> None:  # conns[0].send, and every stage's Close
        if isinstance(msg, p.Close):
            self.caches.pop(msg.stream, None)
            self.closed_streams.append(msg.stream)
            assert all(a.stream != msg.stream for answers in self.held for a in answers if isinstance(a, p.Result)), \
                "Close before answer"
            return
        assert isinstance(msg, p.Step)
        self.steps.append(msg)
        self._answer([self._run(msg)])

    def close(self) -> None:
        pass

    def _run(self, msg: p.Step) -> p.Message | StageFailure:
        n = len(self.steps) - 1
        if n == self.fail_step:
            return StageFailure("stage 1 closed the connection", recoverable=True)
        mask = self.caches.get(msg.stream)
        if mask is None or n == self.refuse_step:
            return p.Error("no_stream", f"stream {msg.stream} is not open", msg.stream, msg.step)
        fed = msg.tensor.to_array()[0].tolist()
        for i in [i for i, m in enumerate(mask) if m][len([m for m in mask if m]) - msg.rewind:]:
            mask[i] = 0
        if msg.compact:
            mask[:] = [m for m in mask if m]
        assert msg.position == sum(mask), f"stream {msg.stream}: position {msg.position}, holds {sum(mask)}"
        assert len(mask) + len(fed) <= self.max_positions, f"stream {msg.stream} overflows without compact"
        mask += [1] * len(fed)
        rows = fed[-p.rows_read(msg.want, len(fed)):]
        return p.Result(msg.stream, msg.step, p.Tensor.from_array(np.array([[NEXT(t) for t in rows]])),
                        {"stage0": 0.001, "stage1": 0.001})


class StreamsHost(ScriptedHost):
    def __init__(self, max_positions: int = MAX_POSITIONS) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.chains: list[ScriptedStreams] = []

    def reconnect(self, stale, deadline: float, cause: OvshardError) -> StreamLink:  # type: ignore[override]
        self.reconnects += 1
        return stream_link(self)


def stream_link(host: StreamsHost, slots: int = 4, hold: bool = False) -> StreamLink:
    host.chains.append(ScriptedStreams(host.max_positions, hold))
    return StreamLink(host.chains[-1], host.max_positions, slots)  # type: ignore[arg-type]


def streams_engine(max_positions: int = MAX_POSITIONS, slots: int = 4, hold: bool = False) -> tuple[Engine,
                                                                                                    StreamsHost]:
    host = StreamsHost(max_positions)
    link = stream_link(host, slots, hold)
    return Engine(host, link, tick_budget(8), max_positions, VOCAB, retry_s=30, timeout=30), host


def test_stateful_streams_give_solo_tokens_a_stream_each_with_rewinds_and_no_cached_prefix() -> None:
    """8 requests (4 stream slots) with drafts half wrong: each gets its solo tokens; rejected drafts are
    rewound on the stream (the scripted stage checks every position); two requests of one prompt both prefill
    it whole (no prefix is shared between streams); every stream opened is closed once its request ended."""
    engine, host = streams_engine()
    spec = Speculation(OffByOne(2), 4, CompactionPolicy(limit=MAX_POSITIONS))
    jobs = [([3 + i % 2, 7, 11, 13, 17], 9 + 2 * i) for i in range(8)]  # 4 prompts, each twice
    requests = [run(engine, prompt, n, spec) for prompt, n in jobs]
    assert [r.result(30) for r in requests] == [solo(prompt, n) for prompt, n in jobs]
    chain = host.chains[0]
    assert chain.max_open <= 4 and sorted(chain.opened) == sorted(chain.closed_streams) and not chain.caches
    assert any(step.rewind for step in chain.steps)
    firsts = [next(s for s in chain.steps if s.stream == seq) for seq in chain.opened]
    assert all(s.position == 0 and s.tensor.shape[1] >= 5 for s in firsts)
    assert all(r.stats.cached_tokens == 0 for r in requests)
    engine.close()


def test_stateful_streams_compact_when_hidden_positions_would_pass_max_positions() -> None:
    """Drafts mostly wrong on a 40-position bundle: the stream compacts before its cache would overflow, and the
    request runs to a full context with its solo tokens."""
    engine, host = streams_engine(max_positions=40)
    request = run(engine, [5, 9], 60, Speculation(OffByOne(1), 4, CompactionPolicy(limit=40)))
    tokens = request.result(30)
    assert tokens == solo([5, 9], len(tokens)) and request.finish_reason == "length" and len(tokens) >= 37
    assert any(step.compact for step in host.chains[0].steps)
    engine.close()


def test_a_cancelled_stateful_request_closes_its_stream_once_its_step_is_answered() -> None:
    """Cancel while a Step of the request is on its way: its stream stays open until the answer, then closes."""
    engine, host = streams_engine(hold=True)
    chain = host.chains[0]
    request = run(engine, [4, 8], 20)
    settle(engine, lambda: len(chain.held) == 1)
    request.cancel()
    settle(engine, lambda: request.done)
    assert chain.caches and not chain.closed_streams  # its Step is still in flight
    chain.release()
    settle(engine, lambda: chain.closed_streams == chain.opened)
    assert request.finish_reason == "cancelled"
    engine.close()


def test_a_stream_waits_for_its_open_while_the_loop_takes_cancels_and_new_requests() -> None:
    """Every stage's OpenOk held: no Step goes before its stream's Open is acknowledged, yet the loop meanwhile
    ends a cancelled request and takes a new one in; once acknowledged, each request gets its solo tokens and
    every stream closes."""
    engine, host = streams_engine()
    chain = host.chains[0]
    chain.hold_opens = True
    first, dropped = run(engine, [4, 8], 6), run(engine, [3], 6)
    settle(engine, lambda: len(chain.opening) == 2)
    assert chain.steps == []
    dropped.cancel()
    settle(engine, lambda: dropped.done)
    late = run(engine, [5, 5], 6)
    settle(engine, lambda: late.index in engine.runs)
    acks, chain.opening, chain.hold_opens = chain.opening, [], False
    for ack in acks:
        ack()
    assert [first.result(30), late.result(30)] == [solo([4, 8], 6), solo([5, 5], 6)]
    assert dropped.finish_reason == "cancelled"
    settle(engine, lambda: sorted(chain.closed_streams) == sorted(chain.opened))
    engine.close()


def test_a_broken_stateful_chain_reopens_streams_and_replays_their_history() -> None:
    """The connection fails at the 6th Step: the engine reconnects, the new chain's streams start at position 0
    with each request's whole history, and both requests finish with their solo tokens."""
    engine, host = streams_engine()
    host.chains[0].fail_step = 5
    requests = [run(engine, [6, 2], 12), run(engine, [7, 1, 3], 10)]
    assert [r.result(30) for r in requests] == [solo([6, 2], 12), solo([7, 1, 3], 10)]
    assert host.reconnects == 1 and all(r.stats.replays == 1 for r in requests)
    fresh = host.chains[1]
    assert all(next(s for s in fresh.steps if s.stream == seq).position == 0 for seq in fresh.opened)
    engine.close()


def test_a_step_a_stage_refused_replays_that_request_alone_on_a_new_stream() -> None:
    """A stage's Error on one Step: that request starts again on a new stream of the same chain; the other
    request is untouched."""
    engine, host = streams_engine()
    chain = host.chains[0]
    chain.refuse_step = 4
    requests = [run(engine, [6, 2], 12), run(engine, [7, 1, 3], 10)]
    assert [r.result(30) for r in requests] == [solo([6, 2], 12), solo([7, 1, 3], 10)]
    assert host.reconnects == 0 and sorted(r.stats.replays for r in requests) == [0, 1]
    assert len(chain.opened) == 3 and sorted(chain.closed_streams) == sorted(chain.opened)
    engine.close()
