"""The engine loop (runtime/scheduling/engine.py) without sockets: a scripted chain answers its ticks in process.

The double is of the transport only: :class:`ScriptedLink` splits each Batch into its rows and answers every row
that wants scores as a last stage would, from a fixed next-token rule (``NEXT``), so a request's solo answer is
known; it can hold its answers (to cancel mid-flight), fail a tick, or refuse a row. The planner, the block
tables, the accept rule and the requests are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.client.streams import StreamLink
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.engine import Engine
from ovshard.runtime.scheduling.links import Deliver
from ovshard.runtime.scheduling.requests import Phase, Request
from ovshard.runtime.scheduling.ticks import tick_budget
from ovshard.runtime.wire import protocol as p

VOCAB, MAX_POSITIONS, BS = 64, 256, 4
W, PF, DE, PE, RE, FI = (Phase.WAITING, Phase.PREFILLING, Phase.DECODING, Phase.PREEMPTED, Phase.REPLAYING,
                         Phase.FINISHED)


def NEXT(token: int) -> int:  # noqa: N802  the scripted model: the token after ``token``
    return (token * 5 + 1) % (VOCAB - 2) + 2


def solo(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = NEXT(last)
        out.append(last)
    return out


class ScriptedLink:
    """A chain of ``depth`` stages in process: answers each Batch's rows by ``NEXT`` (argmax ids, or top-k with
    the right id first); ``hold`` keeps answers until :meth:`release`; ``fail_tick`` / ``refuse`` script faults."""

    def __init__(self, blocks: int = 64, depth: int = 2, hold: bool = False) -> None:
        self.depth, self.blocks = depth, BlockManager(blocks, BS)
        self.hold, self.held = hold, []
        self.sent: list[p.Batch] = []
        self.fail_tick: int | None = None
        self.refuse: tuple[int, int] | None = None  # (tick, row index) to refuse
        self.deliver: Deliver | None = None
        self.closed = False
        self.retired: list[int] = []  # sequences the engine said it is done with
        self.changed = threading.Condition()

    def listen(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def close(self) -> None:
        self.closed = True

    def retire(self, seq: int) -> None:
        self.retired.append(seq)

    def send_tick(self, batch: p.Batch) -> None:
        with self.changed:
            self.sent.append(batch)
            self.changed.notify_all()
        answers = self._answers(batch)
        if self.hold:
            self.held.append(answers)
        else:
            self._give(answers)

    def release(self) -> None:
        held, self.held = self.held, []
        for answers in held:
            self._give(answers)

    def wait_sent(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.sent) >= n, timeout=30), f"{len(self.sent)} ticks sent"

    def _give(self, answers: list[p.Message | StageFailure]) -> None:
        assert self.deliver is not None
        for answer in answers:
            self.deliver(answer)

    def _answers(self, batch: p.Batch) -> list[p.Message | StageFailure]:
        if self.fail_tick == len(self.sent) - 1:
            return [StageFailure(f"tick {batch.tick} lost", recoverable=True)]
        ids = batch.tensor.to_array().tolist()
        out: list[p.Message | StageFailure] = []
        refused = []
        start = 0
        for i, row in enumerate(batch.rows):
            fed, start = ids[start:start + row.count], start + row.count
            if self.refuse == (len(self.sent) - 1, i):
                refused.append(p.Refusal(row.stream, 1, "position", "scripted refusal"))
                continue
            if not row.want:
                continue
            rows = fed[-p.rows_read(row.want, row.count):]
            nexts = np.array([[NEXT(t) for t in rows]], np.int64)  # [1, R]
            if row.want.startswith("argmax"):
                out.append(p.Result(row.stream, batch.tick, p.Tensor.from_array(nexts), {}))
                continue
            k = p.parse_want(row.want)[1] or 1
            indices = np.stack([(nexts + j) % VOCAB for j in range(k)], axis=-1)  # [1, R, K]: the right id first
            values = np.broadcast_to(-np.arange(k, dtype=np.float32) * 10, indices.shape).copy()
            out.append(p.Result(row.stream, batch.tick, p.Tensor.from_array(values, "f32"), {},
                                p.Tensor.from_array(indices)))
        return [*out, p.BatchDone(batch.tick, {"stage0": 0.001}, refused)]


class ScriptedHost:
    """The head's side of a reconnect: a fresh ScriptedLink each time, retry windows that never expire."""

    def __init__(self) -> None:
        self.reconnects, self.replayed = 0, 0

    def reconnect(self, stale: ScriptedLink, deadline: float, cause: OvshardError) -> ScriptedLink:
        self.reconnects += 1
        return ScriptedLink(stale.blocks.num_blocks, stale.depth)

    def expired(self, deadline: float) -> bool:
        return False

    def count_replay(self, tokens: int) -> None:
        self.replayed += tokens


class OffByOne:
    """A drafter whose first ``right`` drafts are the model's next tokens and whose later ones are wrong."""

    name = "scripted"

    def __init__(self, right: int) -> None:
        self.right = right

    def fork(self) -> OffByOne:
        return self

    def draft(self, context: list[int], k: int, config: SamplingConfig, rng: object) -> tuple[list[int], None]:
        good = solo(context, k)
        return [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(good)], None


def engine_over(link: ScriptedLink, host: ScriptedHost | None = None, **config: int) -> Engine:
    settings = tick_budget(config.get("max_seqs", 8), max_chunk=config.get("max_chunk"))
    return Engine(host or ScriptedHost(), link, settings, MAX_POSITIONS, VOCAB, retry_s=30, timeout=30)


def run(engine: Engine, prompt: list[int], n: int, speculation: Speculation | None = None,
        config: SamplingConfig | None = None, index: list[int] = [0]) -> Request:  # noqa: B006  a counter
    index[0] += 1
    request = Request(index[0], prompt, config or SamplingConfig(max_tokens=n))
    engine.submit(request, speculation)
    return request


def settle(engine: Engine, until: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not until():
        assert time.monotonic() < deadline, "the engine never got there"
        time.sleep(0.002)


def test_a_request_goes_waiting_prefilling_decoding_finished_with_its_solo_tokens() -> None:
    """One greedy request: its phases in order, its tokens the scripted model's, its blocks returned."""
    link = ScriptedLink()
    engine = engine_over(link)
    request = run(engine, [5, 9, 13], 12)
    assert request.result(30) == solo([5, 9, 13], 12)
    assert request.phases == [W, PF, DE, FI] and request.finish_reason == "length"
    assert len(request.stats.step_s) == 12 and request.stats.first_token_s > 0
    settle(engine, lambda: engine.stats.blocks.used == 0)
    engine.close()


def test_eight_requests_share_ticks_split_in_equal_groups_over_the_stages() -> None:
    """8 requests on a 2-stage chain: each gets its solo tokens; no tick holds more than ceil(8 / 2) of them."""
    link = ScriptedLink(depth=2)
    engine = engine_over(link)
    jobs = [([3 + i, 7, 11 + i], 5 + 3 * i) for i in range(8)]
    requests = [run(engine, prompt, n) for prompt, n in jobs]
    assert [r.result(30) for r in requests] == [solo(prompt, n) for prompt, n in jobs]
    assert max(len(b.rows) for b in link.sent) <= 4 and engine.stats.seqs > engine.stats.ticks
    engine.close()


def test_an_eos_id_stops_a_request_with_finish_reason_stop() -> None:
    """A token in eos_token_ids ends the request there."""
    engine = engine_over(ScriptedLink())
    tokens = solo([4], 10)
    request = run(engine, [4], 10, config=SamplingConfig(max_tokens=10, eos_token_ids=(tokens[3],)))
    assert request.result(30) == tokens[:4] and request.finish_reason == "stop"
    engine.close()


def test_a_top_k_row_is_sampled_by_the_accept_rule() -> None:
    """A sampled request (top_k=1 over a top-k answer) takes the sampler's path and gives the model's tokens."""
    engine = engine_over(ScriptedLink())
    config = SamplingConfig(temperature=1.0, top_k=1, max_tokens=8, seed=3)
    assert run(engine, [6, 2], 8, config=config).result(30) == solo([6, 2], 8)
    engine.close()


@pytest.mark.parametrize("right", [0, 1, 2, 3, 4])
def test_a_draft_rejected_at_every_position_keeps_the_solo_tokens(right: int) -> None:
    """K = 4 drafts whose first ``right`` are right: each step keeps exactly those plus the target's own token,
    and the output is the plain greedy output."""
    engine = engine_over(ScriptedLink())
    spec = Speculation(OffByOne(right), 4, CompactionPolicy(limit=MAX_POSITIONS))
    request = run(engine, [8, 1, 30], 40, spec)
    assert request.result(30) == solo([8, 1, 30], 40)
    stats = request.stats
    full = [n for n in stats.step_tokens[:-1]]  # the last step may stop early at max_tokens
    assert set(full) == {right + 1} and stats.accepted == sum(n - 1 for n in stats.step_tokens)
    assert stats.rewound_positions == stats.drafted - stats.accepted  # every rejected draft taken back
    assert (stats.rewinds > 0) == (right < 4)  # a row that rejected a draft counts one rewind
    assert all(len(b.rows) == 1 for b in engine.link.sent)  # type: ignore[attr-defined]
    engine.close()


def test_a_full_pool_preempts_and_the_preempted_request_recomputes_to_its_solo_tokens() -> None:
    """Two requests over 6 blocks of 4 positions that each need 4 blocks: the newer is preempted (its phase
    says so), recomputed later, and both give their solo tokens."""
    link = ScriptedLink(blocks=6)
    engine = engine_over(link, max_seqs=2)
    first, second = run(engine, [1, 2, 3], 13), run(engine, [4, 5, 6], 13)
    assert [first.result(30), second.result(30)] == [solo([1, 2, 3], 13), solo([4, 5, 6], 13)]
    assert PE in first.phases + second.phases and engine.stats.preemptions >= 1
    preempted = first if PE in first.phases else second
    assert preempted.phases[preempted.phases.index(PE) + 1] is PF  # recomputed: prefilled again
    engine.close()


def test_a_failed_tick_replays_every_request_on_a_new_chain_with_the_uninterrupted_tokens() -> None:
    """Tick 3 fails: the engine reconnects once, every request starts again with its history (replaying) and
    finishes with its solo tokens; the replayed tokens are counted."""
    link, host = ScriptedLink(depth=2), ScriptedHost()
    link.fail_tick = 3
    engine = engine_over(link, host)
    jobs = [([2, 3], 10), ([9, 8, 7], 12), ([5], 9)]
    requests = [run(engine, prompt, n) for prompt, n in jobs]
    assert [r.result(30) for r in requests] == [solo(prompt, n) for prompt, n in jobs]
    assert host.reconnects == 1 and host.replayed > 0
    assert all(RE in r.phases and r.stats.replays == 1 for r in requests)
    engine.close()


def test_a_send_that_fails_replays_every_request_without_waiting_for_another_event() -> None:
    """Stage 0's connection refuses a tick as it is sent: the loop reconnects at once and every request still
    finishes with its solo tokens."""
    link, host = ScriptedLink(), ScriptedHost()
    sent = link.send_tick

    def refuse_third(batch: p.Batch) -> None:
        if len(link.sent) == 2:
            link.sent.append(batch)
            raise StageFailure("stage 0 at 127.0.0.1:1: send failed: broken pipe", recoverable=True)
        sent(batch)

    link.send_tick = refuse_third  # type: ignore[method-assign]
    engine = engine_over(link, host)
    request = run(engine, [4, 4], 8)
    assert request.result(30) == solo([4, 4], 8) and host.reconnects == 1 and request.stats.replays == 1
    engine.close()


class SlowHost(ScriptedHost):
    """A host whose reconnect waits until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.asked, self.go = threading.Event(), threading.Event()

    def reconnect(self, stale: ScriptedLink, deadline: float, cause: OvshardError) -> ScriptedLink:
        self.asked.set()
        assert self.go.wait(30), "the test never let the reconnect finish"
        return super().reconnect(stale, deadline, cause)


def test_submissions_and_cancels_go_on_while_a_reconnect_is_pending() -> None:
    """While the host is still reconnecting a broken chain, a cancel ends its request at once and a new request is
    taken in; once the chain is back, the survivor replays and the newcomer starts, each with its solo tokens."""
    link, host = ScriptedLink(), SlowHost()
    link.fail_tick = 2
    engine = engine_over(link, host)
    kept, dropped = run(engine, [2, 3], 10), run(engine, [9, 8, 7], 10)
    assert host.asked.wait(30)
    dropped.cancel()
    assert dropped._done.wait(30) and dropped.finish_reason == "cancelled"
    late = run(engine, [5], 6)
    settle(engine, lambda: late.index in engine.runs)
    assert not kept.done and not late.done and late.phases == [W]
    host.go.set()
    assert [kept.result(30), late.result(30)] == [solo([2, 3], 10), solo([5], 6)]
    assert host.reconnects == 1 and kept.stats.replays == 1 and late.stats.replays == 0 and RE not in late.phases
    engine.close()


def test_a_refused_row_starts_that_request_again_on_the_same_chain() -> None:
    """A stage refuses one row: that request replays on the same chain (no reconnect), the other is untouched."""
    link, host = ScriptedLink(), ScriptedHost()
    link.refuse = (2, 0)
    engine = engine_over(link, host)
    a, b = run(engine, [2, 3], 10), run(engine, [9, 8, 7], 10)
    assert [a.result(30), b.result(30)] == [solo([2, 3], 10), solo([9, 8, 7], 10)]
    assert host.reconnects == 0 and a.stats.replays + b.stats.replays == 1
    engine.close()


def test_a_cancelled_waiting_request_ends_before_it_runs() -> None:
    """With one sequence slot taken, a second request waits; cancelled, it ends at once with no token."""
    link = ScriptedLink(hold=True)
    engine = engine_over(link, max_seqs=1)
    running, waiting = run(engine, [1, 2], 5), run(engine, [3, 4], 5)
    link.wait_sent(1)
    waiting.cancel()
    assert waiting._done.wait(30) and waiting.partial == [] and waiting.finish_reason == "cancelled"
    assert waiting.phases == [W, FI]
    link.hold = False
    link.release()
    assert running.result(30) == solo([1, 2], 5)
    engine.close()


def test_a_request_cancelled_while_prefilling_frees_its_blocks_at_once() -> None:
    """A 30-token prompt in chunks of 4: cancelled after its first chunk went out, it ends with no token and
    its blocks are back before its chunks in flight are answered."""
    link = ScriptedLink(hold=True)
    engine = engine_over(link, max_chunk=4)
    request = run(engine, list(range(2, 32)), 5)
    link.wait_sent(1)
    assert request.phase is PF
    request.cancel()
    assert request._done.wait(30) and request.partial == [] and request.finish_reason == "cancelled"
    settle(engine, lambda: engine.stats.blocks.used == 0 and engine.stats.running == 0)
    link.release()  # the answers to its rows come after it left: ignored
    engine.close()


def test_a_request_cancelled_while_decoding_stops_at_the_next_tick_boundary() -> None:
    """Cancelled mid-decode with a tick in flight: it ends there (its tokens so far kept), its blocks freed."""
    link = ScriptedLink(hold=True)
    engine = engine_over(link)
    request = run(engine, [7, 7], 50)
    for n in range(1, 4):
        link.wait_sent(n)
        link.release()
    link.wait_sent(4)
    assert request.phase is DE
    request.cancel()
    assert request._done.wait(30) and request.finish_reason == "cancelled"
    assert request.partial == solo([7, 7], 50)[:3]
    settle(engine, lambda: engine.stats.blocks.used == 0)
    engine.close()


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_held() -> None:
    """A prompt run again finds its full blocks computed: its stats.cached_tokens counts their positions."""
    engine = engine_over(ScriptedLink())
    prompt = list(range(2, 11))  # 9 ids: 2 full blocks of 4 before the last one
    first = run(engine, prompt, 3)
    first.result(30)
    second = run(engine, prompt, 3)
    assert second.result(30) == solo(prompt, 3)
    assert (first.stats.cached_tokens, second.stats.cached_tokens) == (0, 8)
    engine.close()


def test_a_paced_request_runs_at_most_one_step_ahead_of_its_reader() -> None:
    """A paced request (Head.generate's) computes its next step while its reader takes the last one, and no
    further: once a step ends with a token of the step before unread, its next row waits for the reader. The
    reader here reads one token and stops: the engine ran one step past it (two if the reader took its token
    before the second step ended), then waited."""
    link = ScriptedLink()
    engine = engine_over(link)
    request = Request(99, [3, 1], SamplingConfig(max_tokens=20), paced=True)
    engine.submit(request)
    tokens = request.tokens()
    assert next(tokens) == solo([3, 1], 1)[0]
    time.sleep(0.05)  # a free-running request would be done by now
    assert len(request.partial) in (2, 3) and len(link.sent) == len(request.partial)
    assert [next(tokens), *tokens] == solo([3, 1], 20)[1:]
    engine.close()


def test_closing_the_engine_ends_running_requests_with_an_error() -> None:
    """close() while a request waits on an answer: it ends with an error, not a hang."""
    link = ScriptedLink(hold=True)
    engine = engine_over(link)
    request = run(engine, [1], 10)
    link.wait_sent(1)
    engine.close()
    assert request._done.wait(30) and request.finish_reason == "error"


# ----- stateful stages: the engine over a StreamLink, a Step a row on the sequence's own stream -----

class ScriptedStreams:
    """A chain of stateful stages in process, as a StreamLink sees it (``conns[0]``, ``open_stream``,
    ``listen``): it keeps each open stream's cache as a stage does and refuses what a stage refuses
    (node/steps.check_step: the position after the rewind, the physical cache past max_positions without
    compact), answers each Step's rows by ``NEXT``; ``hold`` keeps answers, ``refuse_step`` / ``fail_step``
    script a stage's Error on the n-th Step and a lost connection."""

    def __init__(self, max_positions: int = MAX_POSITIONS, hold: bool = False) -> None:
        self.depth, self.addresses, self.conns = 2, ["scripted:0", "scripted:1"], [self]
        self.max_positions, self.hold = max_positions, hold
        self.caches: dict[int, list[int]] = {}  # stream -> its mask (1 visible, 0 hidden)
        self.steps: list[p.Step] = []
        self.held: list[p.Message | StageFailure] = []
        self.opened: list[int] = []
        self.closed_streams: list[int] = []
        self.refuse_step: int | None = None
        self.fail_step: int | None = None
        self.deliver: Deliver | None = None
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

    def listen(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def send(self, msg: p.Message) -> None:  # conns[0].send, and every stage's Close
        if isinstance(msg, p.Close):
            self.caches.pop(msg.stream, None)
            self.closed_streams.append(msg.stream)
            assert all(a.stream != msg.stream for a in self.held if isinstance(a, p.Result)), "Close before answer"
            return
        assert isinstance(msg, p.Step)
        self.steps.append(msg)
        answer = self._run(msg)
        if self.hold:
            self.held.append(answer)
        else:
            self._give(answer)

    def answer_held(self) -> None:
        held, self.held = self.held, []
        for answer in held:
            self._give(answer)

    def close(self) -> None:
        pass

    def _give(self, answer: p.Message | StageFailure) -> None:
        assert self.deliver is not None
        self.deliver(answer)

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
    chain.answer_held()
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
