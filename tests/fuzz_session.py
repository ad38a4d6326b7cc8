"""The rules a one-stage stateful worker follows for one head session, restated for tests/fuzz_worker.py.

:class:`SessionModel` holds a session's open streams and their positions, what the worker owes each request
(OpenOk, Pong, a Result of a given shape, an Error with a given code, stream and reply_to, or nothing: runtime/node's
order of checks), and makes the hostile requests to send it; :class:`Spec` is what a client knows of the
worker; the limits below are those the fuzz run starts the worker with.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import DEFAULT_MAX_FRAME, MAX_HEADER_BYTES

# The worker's limits for the run: small stream caps, so the leak check can fill them through the protocol;
# as many sessions as connections, so a full house of head sessions shows a leak of either; a short frame
# timeout, so stalled frames are answered while the fuzz runs.
MAX_CONNECTIONS = 512
MAX_STREAMS = 64
MAX_STREAMS_PER_SESSION = 32
FRAME_TIMEOUT_S = 2.0
PRE_AUTH_FRAME_BYTES = 4096  # Limits.pre_auth_frame_bytes
WANTS = ["argmax", "argmax", "argmax@1", "argmax@3", "logits", "logits@2", "topk:1", "topk:40", "topk:600",
         "topk:5@4", "topk:999999999@999999999", "logits@999999999"]


class Mismatch(Exception):
    """A reply (or its absence) that the worker's rules do not allow."""


@dataclass(frozen=True)
class Spec:
    """What a client needs to know of the worker and its bundle."""

    host_port: tuple[str, int]
    fingerprint: str
    vocab: int
    max_positions: int
    hidden: int

    @property
    def tokens(self) -> list[int]:
        """The token counts a Step may carry. Few on purpose: the worker's RSS grows by ~0.4 MB the first
        time it runs each new count (OpenVINO's per-shape caches), so warm-up runs every one of them once."""
        m = self.max_positions
        return [*range(1, 9), 9, 16, 31, 64, 100, m // 2 - 1, m // 2, m - 12, m - 1, m, m + 1, m + 16]

    @property
    def max_frame(self) -> int:
        """The worker's frame cap after the handshake: a Step of every position (stage 0: i64 ids)."""
        return min(DEFAULT_MAX_FRAME, MAX_HEADER_BYTES + self.max_positions * 8)


# ----- the model of one head session -----

@dataclass
class StreamState:
    visible: int = 0  # the next position id
    physical: int = 0  # cached positions, holes included


def expect_error(reply: p.Message, code: str, stream: int | None, seq: int | None, words: str = "") -> None:
    if not (isinstance(reply, p.Error) and reply.code == code and reply.stream == stream and reply.reply_to == seq
            and words in reply.message):
        raise Mismatch(f"expected Error {code} (stream {stream}, seq {seq}{', ' + words if words else ''}), "
                       f"got {reply!r:.300}")


class SessionModel:
    """One head session as a one-stage worker holds it (open streams and their counts), what the worker owes
    each request (worker.py's order of checks), and hostile requests to send it."""

    def __init__(self, spec: Spec, session: str) -> None:
        self.spec, self.session = spec, session
        self.streams: dict[int, StreamState] = {}
        self.last_step = 0

    # --- what the worker owes ---
    def settle(self, msg: p.Message, read: Callable[[], p.Message]) -> bool:
        """Read and check the reply ``msg`` is owed; False if the worker closes the connection after it."""
        if isinstance(msg, p.Ping):
            if (reply := read()) != p.Pong(msg.nonce):
                raise Mismatch(f"expected Pong({msg.nonce}), got {reply!r:.300}")
        elif isinstance(msg, p.Open):
            self.settle_open(msg.stream, read())
        elif isinstance(msg, p.Reset):
            if msg.stream in self.streams:
                self.streams[msg.stream] = StreamState()
            else:
                expect_error(read(), "no_stream", msg.stream, None)
        elif isinstance(msg, p.Close):
            self.streams.pop(msg.stream, None)
        elif isinstance(msg, p.Step):
            code = self.step_refusal(msg)
            if code is not None:
                expect_error(read(), code, msg.stream, msg.step)
            else:
                self.check_result(msg, read())
                self.advance(msg)
        else:  # Hello, HelloOk, OpenOk, Result, Error, Pong: not a head's to send
            expect_error(read(), "unknown_kind", None, None)
            return False
        return True

    def settle_open(self, stream: int, reply: p.Message) -> None:
        if stream in self.streams:
            expect_error(reply, "refused", stream, None)
        elif len(self.streams) >= MAX_STREAMS_PER_SESSION:
            expect_error(reply, "busy", stream, None, "--max-streams-per-session")
        elif reply == p.OpenOk(stream):
            self.streams[stream] = StreamState()
        else:  # the worker-wide cap, which other clients share
            expect_error(reply, "busy", stream, None, "--max-streams)")

    def step_refusal(self, msg: p.Step) -> str | None:
        state, t = self.streams.get(msg.stream), msg.tensor
        if state is None:
            return "no_stream"
        if t.dtype not in ("i64", "i32") or len(t.shape) != 2:
            return "failed"
        ids = t.to_array(np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab:
            return "failed"
        if msg.timings:  # stage 0 takes none: no stage comes before it
            return "failed"
        if msg.rewind > state.visible or msg.position != state.visible - msg.rewind:
            return "position"
        if msg.position + t.shape[1] > self.spec.max_positions:
            return "position"
        if (msg.position if msg.compact else state.physical) + t.shape[1] > self.spec.max_positions:
            return "position"  # the physical cache would pass the rotary table: compact first
        return None

    def advance(self, msg: p.Step) -> None:
        state = self.streams[msg.stream]
        state.visible -= msg.rewind
        if msg.compact:
            state.physical = state.visible
        state.physical += msg.tensor.shape[1]
        state.visible += msg.tensor.shape[1]

    def check_result(self, msg: p.Step, reply: p.Message) -> None:
        mode, k, rows = p.parse_want(msg.want)
        tokens, vocab = msg.tensor.shape[1], self.spec.vocab
        if mode == "argmax":
            want = ("i64", (1, min(rows or tokens, tokens)), None)
        else:
            last = min(rows or 1, tokens)
            want = (("f32", (1, last, min(k, vocab)), ("i64", (1, last, min(k, vocab)))) if mode == "topk"
                    else ("f32", (1, last, vocab), None))
        if not isinstance(reply, p.Result) or (reply.stream, reply.reply_to) != (msg.stream, msg.step):
            raise Mismatch(f"expected the Result of stream {msg.stream} step {msg.step}, got {reply!r:.300}")
        got = (reply.tensor.dtype, reply.tensor.shape,
               None if reply.indices is None else (reply.indices.dtype, reply.indices.shape))
        if got != want or set(reply.timings) != {*msg.timings, "stage0"}:
            raise Mismatch(f"Result for want {msg.want!r} of {tokens} tokens: expected {want}, got {got}, "
                           f"timings {sorted(reply.timings)[:8]}")
        ids = reply.tensor if mode == "argmax" else reply.indices
        if ids is not None and not np.all((ids.to_array() >= 0) & (ids.to_array() < vocab)):
            raise Mismatch(f"Result ids outside [0, {vocab}): {ids.to_array().ravel()[:8]}")

    # --- hostile requests ---
    def stream_id(self, rng: random.Random) -> int:
        roll = rng.random()
        if self.streams and roll < 0.5:
            return rng.choice(list(self.streams))
        return rng.randrange(8) if roll < 0.8 else rng.randrange(48) if roll < 0.95 else rng.getrandbits(63)

    def hostile_request(self, rng: random.Random) -> p.Message:
        roll = rng.random()
        if roll < 0.3:
            return p.Ping(rng.getrandbits(63))
        if roll < 0.5:
            return p.Open(self.stream_id(rng))
        if roll < 0.55:  # rare: a fresh stream's first Step costs the worker ~3 ms, a later one ~1.5 ms
            return p.Close(self.stream_id(rng))
        if roll < 0.6:
            return p.Reset(self.stream_id(rng))
        return self.step(rng)

    def step(self, rng: random.Random) -> p.Step:
        stream = rng.choice(list(self.streams)) if self.streams and rng.random() < 0.85 else self.stream_id(rng)
        visible = self.streams[stream].visible if stream in self.streams else 0
        tokens = rng.choice(self.spec.tokens) if rng.random() < 0.1 else 1 if rng.random() < 0.6 else rng.randint(2, 8)
        roll = rng.random()
        rewind = 0 if roll < 0.7 or not visible else rng.randint(1, visible) if roll < 0.95 else visible + rng.randint(1, 3)
        position = max(0, visible - rewind)
        if rng.random() < 0.12:
            position = rng.choice([position + 1, max(0, position - 1), 0, self.spec.max_positions, 2**63 - 1])
        timings = {} if rng.random() < 0.9 else {
            rng.choice(["stage0", "queue", "x" * 250, "é"]) + str(i): rng.random() for i in range(rng.randint(1, 8))}
        self.last_step += 1
        step = self.last_step if rng.random() < 0.95 else rng.getrandbits(63)
        return p.Step(stream, step, position, rng.choice(WANTS), self.step_tensor(rng, tokens), timings, rewind,
                      rng.random() < 0.1)

    def step_tensor(self, rng: random.Random, tokens: int) -> p.Tensor:
        ids = np.array([[rng.randrange(self.spec.vocab) for _ in range(tokens)]], np.int64)
        roll = rng.random()
        if roll < 0.07:
            ids[0, rng.randrange(tokens)] = rng.choice([-1, self.spec.vocab, 2**31 - 1, -(2**31)])
        if roll < 0.9:
            return p.Tensor.from_array(ids)
        if roll < 0.95:
            return p.Tensor.from_array(ids, "i32")
        wrong = rng.choice([("f16", (1, tokens, self.spec.hidden)), ("f32", (1, tokens)), ("i64", (1, tokens, 1)),
                            ("i32", (1, tokens, 2))])
        return p.Tensor(wrong[0], wrong[1], bytes(int(np.prod(wrong[1])) * p.DTYPES[wrong[0]].itemsize))  # type: ignore[arg-type]

    def forbidden_message(self, rng: random.Random) -> p.Message:
        """A well-formed message a head must never send to a stage."""
        fp, ids = self.spec.fingerprint, p.Tensor.from_array(np.array([[1]], np.int64))
        return rng.choice([p.Result(0, 0, ids, {}), p.HelloOk(0, fp, 1), p.OpenOk(0), p.Pong(1),
                           p.Error("failed", "from a head"), p.Hello("head", p.PROTOCOL_VERSION, fp, 0, self.session)])
