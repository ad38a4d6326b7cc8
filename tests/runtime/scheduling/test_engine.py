"""The engine loop (runtime/scheduling/engine.py) without sockets, on the paged backend: a scripted chain
(scripted_chain.py) answers its ticks in process; the planner, the block tables, the accept rule and the
requests are the real ones."""

from __future__ import annotations

import threading
import time

import pytest
from scripted_chain import (
    DE,
    FI,
    MAX_POSITIONS,
    PE,
    PF,
    RE,
    OffByOne,
    ScriptedHost,
    ScriptedLink,
    W,
    engine_over,
    run,
    settle,
    solo,
)

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.wire import protocol as p


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

