"""A real worker process under hostile input: a short fuzz run, and a stateful model of sessions and streams."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32
from fuzz_frames import receive
from fuzz_session import MAX_STREAMS_PER_SESSION, Spec
from fuzz_worker import RSS_BOUND_MB, handshake, run_fuzz
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ovshard.bundle.manifest import bundle_fingerprint, read_manifest
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import encode

pytestmark = pytest.mark.slow


TOKENS = st.lists(st.sampled_from([1, 403, 407, 0, 511]), min_size=1, max_size=4)  # few: histories repeat
STREAMS = st.integers(0, 3)


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("fuzz") / "b1", stages=1)


@pytest.fixture(scope="module")
def spec(bundle: Path) -> Iterator[Spec]:
    """One worker process with default limits and stateful streams, for every test of this module but the fuzz
    run."""
    worker = WorkerProcess(serve_command(bundle, 0, "127.0.0.1:0", ["--kv", "stateful"]), 0)
    try:
        host, port = worker.wait_listening(120).rsplit(":", 1)
        manifest = read_manifest(bundle)
        yield Spec((host, int(port)), bundle_fingerprint(bundle), manifest.architecture.vocab_size,
                   manifest.runtime_hints.max_positions, manifest.architecture.hidden_size)
    finally:
        worker.stop()


def test_a_short_fuzz_run_leaves_the_worker_whole(bundle: Path) -> None:
    """20,000 hostile frames: every reply as the model says, no crash, same tokens after, no leak, bounded RSS."""
    report = run_fuzz(20_000, seed=1, workers=1, bundle=bundle)
    assert report["frames"] == 20_000
    assert {key: report[key] for key in ("worker_crashes", "failures", "internal_errors", "same_generation",
                                         "leaked_connections", "leaked_sessions", "leaked_streams")} == {
        "worker_crashes": 0, "failures": 0, "internal_errors": 0, "same_generation": True,
        "leaked_connections": 0, "leaked_sessions": 0, "leaked_streams": 0}
    assert report["rss_growth_mb"] <= RSS_BOUND_MB
    assert report["results"] > 1000 and report["sessions"] > 50  # it ran Steps, over many sessions


class Sessions(RuleBasedStateMachine):
    """Two head connections with distinct sessions on one worker; ``visible`` mirrors each open stream's
    count and ``history`` its steps since the last Open or Reset."""

    spec: Spec  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.socks: list[socket.socket] = []
        for _ in range(2):
            sock, reply = handshake(self.spec)
            self.socks.append(sock)
            assert isinstance(reply, p.HelloOk), reply
        self.visible: list[dict[int, int]] = [{}, {}]
        self.history: list[dict[int, tuple]] = [{}, {}]
        self.outcomes: dict[tuple, list[int]] = {}  # steps since an Open -> the argmax ids of the last one
        self.last_step = 0

    def teardown(self) -> None:
        for sock in self.socks:
            sock.close()

    def ask(self, who: int, *msgs: p.Message) -> p.Message | None:
        """Send ``msgs`` on connection ``who`` and a Ping; the one reply before the Pong (None if none)."""
        self.socks[who].sendall(b"".join(encode(m) for m in msgs) + encode(p.Ping(99)))
        first = receive(self.socks[who])
        if first == p.Pong(99):
            return None
        assert receive(self.socks[who]) == p.Pong(99), "one reply at most, then the Pong"
        return first

    def step(self, who: int, stream: int, position: int, tokens: list[int], rewind: int = 0) -> p.Message | None:
        self.last_step += 1
        ids = p.Tensor.from_array(np.array([tokens], np.int64))
        return self.ask(who, p.Step(stream, self.last_step, position, "argmax", ids, {}, rewind))

    @rule(who=st.integers(0, 1), stream=STREAMS)
    def open(self, who: int, stream: int) -> None:
        reply = self.ask(who, p.Open(stream))
        if stream in self.visible[who]:
            assert isinstance(reply, p.Error) and (reply.code, reply.stream) == ("refused", stream), reply
        else:
            assert reply == p.OpenOk(stream)
            self.visible[who][stream], self.history[who][stream] = 0, ()

    @rule(who=st.integers(0, 1), stream=STREAMS)
    def close(self, who: int, stream: int) -> None:
        assert self.ask(who, p.Close(stream)) is None  # Close is never answered
        self.visible[who].pop(stream, None)
        self.history[who].pop(stream, None)

    @rule(who=st.integers(0, 1), stream=STREAMS)
    def reset(self, who: int, stream: int) -> None:
        reply = self.ask(who, p.Reset(stream))
        if stream in self.visible[who]:
            assert reply is None
            self.visible[who][stream], self.history[who][stream] = 0, ()
        else:
            assert isinstance(reply, p.Error) and (reply.code, reply.stream) == ("no_stream", stream), reply

    def pick(self, who: int, data: st.DataObject) -> int:
        """A stream id for a Step: mostly one of ``who``'s open streams."""
        if self.visible[who] and data.draw(st.integers(0, 9)) < 8:
            return data.draw(st.sampled_from(sorted(self.visible[who])))
        return data.draw(STREAMS)

    @rule(who=st.integers(0, 1), tokens=TOKENS, data=st.data())
    def step_at_the_right_position(self, who: int, tokens: list[int], data: st.DataObject) -> None:
        stream = self.pick(who, data)
        visible = self.visible[who].get(stream, 0)
        rewind = data.draw(st.integers(0, visible))
        reply = self.step(who, stream, visible - rewind, tokens, rewind)
        if stream not in self.visible[who]:
            assert isinstance(reply, p.Error) and (reply.code, reply.reply_to) == ("no_stream", self.last_step), reply
            return
        assert isinstance(reply, p.Result) and (reply.stream, reply.reply_to) == (stream, self.last_step), reply
        got = reply.tensor.to_array()[0].tolist()
        assert len(got) == len(tokens) and all(0 <= t < self.spec.vocab for t in got)
        history = (*self.history[who][stream], (rewind, *tokens))
        assert self.outcomes.setdefault(history, got) == got, "the same steps gave other tokens"
        self.visible[who][stream] = visible - rewind + len(tokens)
        self.history[who][stream] = history

    @rule(who=st.integers(0, 1), tokens=TOKENS, offset=st.integers(-3, 3).filter(bool) | st.just(10**6),
          data=st.data())
    def step_at_a_wrong_position(self, who: int, tokens: list[int], offset: int, data: st.DataObject) -> None:
        stream = self.pick(who, data)
        visible = self.visible[who].get(stream, 0)
        if visible + offset >= 0:
            reply = self.step(who, stream, visible + offset, tokens)
        else:  # a rewind past the first position
            reply = self.step(who, stream, visible, tokens, rewind=visible + 1)
        code = "position" if stream in self.visible[who] else "no_stream"
        assert isinstance(reply, p.Error) and (reply.code, reply.stream, reply.reply_to) == (code, stream, self.last_step), reply

    @precondition(lambda self: any(s not in self.visible[1 - w] for w in (0, 1) for s in self.visible[w]))
    @rule(data=st.data())
    def touch_the_other_sessions_stream(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from([w for w in (0, 1) if any(s not in self.visible[1 - w] for s in self.visible[w])]))
        other = 1 - owner
        stream = data.draw(st.sampled_from(sorted(s for s in self.visible[owner] if s not in self.visible[other])))
        visible = self.visible[owner][stream]
        stepped = self.step(other, stream, visible, [1])
        assert isinstance(stepped, p.Error) and (stepped.code, stepped.stream) == ("no_stream", stream), stepped
        reset = self.ask(other, p.Reset(stream))
        assert isinstance(reset, p.Error) and (reset.code, reset.stream) == ("no_stream", stream), reset
        assert self.ask(other, p.Close(stream)) is None
        kept = self.step(owner, stream, visible, [1])  # the owner's stream is still there, at its position
        assert isinstance(kept, p.Result) and kept.stream == stream, kept
        self.visible[owner][stream] += 1
        self.history[owner][stream] = (*self.history[owner][stream], (0, 1))

    @invariant()
    def both_connections_still_answer(self) -> None:
        for sock in self.socks:
            sock.sendall(encode(p.Ping(7)))
            assert receive(sock) == p.Pong(7)


def test_sessions_own_their_streams_and_positions_are_checked(spec: Spec) -> None:
    """Open/Close/Reset/Step on two sessions follow the model: one session cannot touch the other's streams
    (no_stream), an Open gets OpenOk, a wrong position gets "position", and every refusal keeps the connection."""
    Sessions.spec = spec
    run_state_machine_as_test(Sessions, settings=settings(max_examples=100, stateful_step_count=40, deadline=None))


def test_the_per_session_stream_cap_answers_busy_and_keeps_the_connection(spec: Spec) -> None:
    """A session's 33rd Open is refused busy (the cap is per session: another session still opens), and the
    connection is still served."""
    (a, ok_a), (b, ok_b) = handshake(spec), handshake(spec)
    with a, b:
        assert isinstance(ok_a, p.HelloOk) and isinstance(ok_b, p.HelloOk)
        a.sendall(b"".join(encode(p.Open(s)) for s in range(MAX_STREAMS_PER_SESSION + 1)))
        replies = [receive(a) for _ in range(MAX_STREAMS_PER_SESSION + 1)]
        assert replies[:-1] == [p.OpenOk(s) for s in range(MAX_STREAMS_PER_SESSION)]
        assert isinstance(replies[-1], p.Error) and replies[-1].code == "busy"
        b.sendall(encode(p.Open(0)))
        assert receive(b) == p.OpenOk(0)
        a.sendall(encode(p.Ping(5)))
        assert receive(a) == p.Pong(5)


def test_a_step_with_more_timings_than_stages_before_it_is_refused(spec: Spec) -> None:
    """Stage k takes at most k timings (one per earlier stage): 64 of them get a `failed` Error, never a Result
    with 65 that no head could read; the connection stays."""
    sock, reply = handshake(spec)
    with sock:
        assert isinstance(reply, p.HelloOk)
        sock.sendall(encode(p.Open(0)))
        assert receive(sock) == p.OpenOk(0)
        timings = {f"hop{i}": 0.001 for i in range(64)}
        sock.sendall(encode(p.Step(0, 1, 0, "argmax", p.Tensor.from_array(np.array([[1, 403]], np.int64)), timings)))
        refused = receive(sock)
        assert isinstance(refused, p.Error) and refused.code == "failed" and refused.reply_to == 1
        sock.sendall(encode(p.Ping(3)))
        assert receive(sock) == p.Pong(3)




def test_a_short_batch_fuzz_run_leaves_the_paged_worker_whole(bundle: Path) -> None:
    """20,000 hostile Batch frames at a paged worker: every reply as batch_fuzz.owed says, no crash, same tokens
    after, its whole KV pool grantable again, bounded RSS."""
    from batch_fuzz import RSS_BOUND_MB as BATCH_RSS_BOUND_MB
    from batch_fuzz import run as run_batch_fuzz

    report = run_batch_fuzz(20_000, seed=1, bundle=bundle)
    assert report["frames"] == 20_000 and report["failures"] == 0
    assert report["worker_alive"] and report["same_generation"] and report["pool_whole"]
    assert report["rss_growth_mb"] <= BATCH_RSS_BOUND_MB
    assert report["results"] > 10_000 and report["refused_rows"] > 5_000 and report["refused_batches"] > 500
