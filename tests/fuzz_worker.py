"""Fuzz a real stage worker over loopback TCP, then check it survived, still serves, did not bloat, leaked nothing.

    python tests/fuzz_worker.py --frames N [--seed S] [--workers W] [--bundle PATH]

One ``ovshard serve`` process (stage 0 of a one-stage fp32 stories260K bundle) takes N frames from W client
processes (one in-process client when W is 1). Most frames travel on long-lived handshaken sessions:

  (c) valid but hostile requests in batches: Open/Reset/Close of random stream ids, Steps with right and wrong
      positions, rewinds, compaction, out-of-range token ids, wrong dtypes and shapes, odd ``want``s, Pings,
      and requests whose frame was mutated but still decodes. A session ends cleanly, or with a message a head
      must not send (Result, HelloOk, OpenOk, Pong, Error, a second Hello), with (a) random bytes, (b) a
      valid frame with mutated bytes (bit flips, cuts, changed or huge lengths, a field swapped for random
      JSON), or (d) a drop mid-frame or with requests in flight.

Some connections never finish a handshake: random bytes, mutated or refused Hellos, a request before the
Hello, a Hello cut short. A background thread leaves frames half-sent, which the worker must time out.

Every reply is checked against :class:`SessionModel`, worker.py's rules restated: what each request is owed
(OpenOk, Pong, a Result of a given shape, an Error with a given code, stream and seq, or nothing), in request
order; a malformed frame is owed the Error code the local decoder gives the same bytes, then a close. After
the fuzz the worker must be alive, generate the tokens it generated before, have grown its RSS by at most
RSS_BOUND_MB since warm-up, and have its whole capacity: MAX_CONNECTIONS head sessions at once (one more
turned away) and MAX_STREAMS streams before its worker-wide cap answers busy, so no connection, session or
stream leaked. Prints one JSON line; exits 1 on any failure, with each failure (and its frames, in hex) on
stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import random
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from ovshard.bundle.manifest import bundle_fingerprint
from ovshard.errors import OvshardError
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import DEFAULT_MAX_FRAME, MAX_HEADER_BYTES, PREFIX, encode, read_message

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
PROMPT = [1, 403, 407]
# The worker's limits for the run: small stream caps, so the leak check can fill them through the protocol;
# as many sessions as connections, so a full house of head sessions shows a leak of either; a short frame
# timeout, so stalled frames are answered while the fuzz runs.
MAX_CONNECTIONS = 512
MAX_STREAMS = 64
MAX_STREAMS_PER_SESSION = 32
FRAME_TIMEOUT_S = 2.0
PRE_AUTH_FRAME_BYTES = 4096  # Limits.pre_auth_frame_bytes
WORKER_OPTIONS = ["--kv", "stateful",  # the stream messages: Batches are fuzzed by tests/batch_fuzz.py
                  "--max-connections", str(MAX_CONNECTIONS), "--max-sessions", str(MAX_CONNECTIONS),
                  "--max-streams", str(MAX_STREAMS), "--max-streams-per-session", str(MAX_STREAMS_PER_SESSION),
                  "--frame-timeout", str(FRAME_TIMEOUT_S)]
# How much the worker's RSS may grow after warm-up (which already filled every cap once). What the worker may
# keep on purpose is less: MAX_STREAMS KV caches of the tiny model (5 layers x 2 x 4 heads x 8 x 4 B = 1.25 KiB
# a position, 512 positions: 40 MiB in all, and freed when their sessions end), allocator slack (glibc keeps
# freed arenas for up to 8 x cores threads) and the log buffers. A leaked stream or frame buffer per
# connection, over the thousands of connections of a run, shows far above it.
RSS_BOUND_MB = 100.0
REPLY_TIMEOUT_S = 30.0
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
    if not (isinstance(reply, p.Error) and reply.code == code and reply.stream == stream and reply.seq == seq
            and words in reply.message):
        raise Mismatch(f"expected Error {code} (stream {stream}, seq {seq}{', ' + words if words else ''}), "
                       f"got {reply!r:.300}")


class SessionModel:
    """One head session as a one-stage worker holds it (open streams and their counts), what the worker owes
    each request (worker.py's order of checks), and hostile requests to send it."""

    def __init__(self, spec: Spec, session: str) -> None:
        self.spec, self.session = spec, session
        self.streams: dict[int, StreamState] = {}
        self.seq = 0

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
                expect_error(read(), code, msg.stream, msg.seq)
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
        if not isinstance(reply, p.Result) or (reply.stream, reply.seq) != (msg.stream, msg.seq):
            raise Mismatch(f"expected the Result of stream {msg.stream} seq {msg.seq}, got {reply!r:.300}")
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
        self.seq += 1
        seq = self.seq if rng.random() < 0.95 else rng.getrandbits(63)
        return p.Step(stream, seq, position, rng.choice(WANTS), self.step_tensor(rng, tokens), timings, rewind,
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


# ----- one client: sessions, side episodes, counts -----

@dataclass
class Counts:
    frames: int = 0
    connections: int = 0
    sessions: int = 0
    replies: int = 0
    results: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for name in ("frames", "connections", "sessions", "replies", "results"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n
        self.failures += other.failures


class Client:
    """Sends exactly ``frames`` frames to the worker and checks every reply against :class:`SessionModel`."""

    def __init__(self, spec: Spec, frames: int, seed: int) -> None:
        self.spec, self.left, self.rng, self.seed = spec, frames, random.Random(seed), seed
        self.counts = Counts()
        self.model: SessionModel | None = None
        self.sock: socket.socket | None = None
        self.sent: list[tuple[int, bytes]] = []  # (connection, frame), the latest few: for a failure report

    def run(self) -> Counts:
        while self.left > 0:
            roll = self.rng.random()
            try:
                if roll < 0.03 or self.left < 3:
                    self.side_episode()
                elif self.model is None:
                    self.open_session()
                elif roll < 0.07:
                    self.end_session()
                else:
                    self.batch()
            except Mismatch as e:
                self.fail(str(e))
            except ConnectionRefusedError:
                self.fail("the worker refuses connections: is it still running?")
                break
            except OSError as e:
                self.fail(f"{type(e).__name__}: {e}")
        self.drop(abort=False)
        return self.counts

    # --- plumbing ---
    def fail(self, what: str) -> None:
        if len(self.counts.failures) < 20:
            self.counts.failures.append({"seed": self.seed, "what": what,
                                         "frames": [(c, f.hex()[:1000]) for c, f in self.sent[-4:]]})
        else:  # something is badly wrong: stop here
            self.left = 0
        self.drop(abort=True)

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.spec.host_port, timeout=REPLY_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.counts.connections += 1
        return sock

    def send(self, sock: socket.socket, frames: list[bytes]) -> None:
        self.left -= len(frames)
        self.counts.frames += len(frames)
        self.sent = (self.sent + [(self.counts.connections, f) for f in frames])[-8:]
        sock.sendall(b"".join(frames))

    def read(self, sock: socket.socket) -> p.Message:
        try:
            reply = receive(sock)
        except p.ProtocolError as e:
            raise Mismatch(f"the worker sent a frame its peers must refuse: {e}") from e
        except TimeoutError as e:
            raise Mismatch(f"no reply within {REPLY_TIMEOUT_S:.0f} s") from e
        except (p.ConnectionClosed, OSError) as e:
            raise Mismatch(f"the worker closed the connection early: {e}") from e
        self.counts.replies += 1
        if isinstance(reply, p.Error):
            self.counts.errors[reply.code] = self.counts.errors.get(reply.code, 0) + 1
        elif isinstance(reply, p.Result):
            self.counts.results += 1
        return reply

    def expect_close(self, sock: socket.socket) -> None:
        """Nothing more arrives: the worker closes (FIN or RST) within the reply timeout."""
        try:
            extra = receive(sock)
        except (p.ConnectionClosed, ConnectionResetError):
            return
        except TimeoutError as e:
            raise Mismatch(f"the worker kept the connection open {REPLY_TIMEOUT_S:.0f} s after it should close") from e
        except p.ProtocolError as e:
            raise Mismatch(f"the worker sent a frame its peers must refuse: {e}") from e
        raise Mismatch(f"expected the worker to close the connection, got {extra!r:.300}")

    def drop(self, abort: bool) -> None:
        if self.sock is not None:
            close(self.sock, abort)
        self.sock, self.model = None, None

    # --- sessions ---
    def open_session(self) -> None:
        self.sock = self.connect()
        session = session_id(self.rng)
        self.send(self.sock, [encode(p.Hello("head", p.PROTOCOL_VERSION, self.spec.fingerprint, 0, session))])
        if (reply := self.read(self.sock)) != p.HelloOk(0, self.spec.fingerprint, 1):
            raise Mismatch(f"expected HelloOk to a valid Hello, got {reply!r:.300}")
        self.model = SessionModel(self.spec, session)
        self.counts.sessions += 1

    def batch(self) -> None:
        """1-12 hostile requests (some with mutated frames that still decode) and a Ping, checked in order."""
        sock, model = self.sock, self.model
        assert sock is not None and model is not None
        frames, requests = [], []
        for _ in range(min(self.rng.randint(1, 12), self.left - 1)):
            msg = model.hostile_request(self.rng)
            data = encode(msg)
            if self.rng.random() < 0.1:
                mutated = mutate(data, self.rng)
                decoded, tail = decode_all(mutated, self.spec.max_frame)
                if tail is None and len(decoded) == 1 and isinstance(decoded[0], (p.Ping, p.Open, p.Reset, p.Close,
                                                                                   p.Step)):
                    msg, data = decoded[0], mutated
            frames.append(data)
            requests.append(msg)
        requests.append(p.Ping(self.rng.getrandbits(63)))
        self.send(sock, frames + [encode(requests[-1])])
        for msg in requests:
            model.settle(msg, lambda: self.read(sock))

    def end_session(self) -> None:
        sock, model, how = self.sock, self.model, self.rng.random()
        assert sock is not None and model is not None
        if how < 0.3:  # a clean close
            self.drop(abort=False)
        elif how < 0.5:  # a message a head must not send
            self.send(sock, [encode(model.forbidden_message(self.rng))])
            expect_error(self.read(sock), "unknown_kind", None, None)
            self.expect_close(sock)
            self.drop(abort=False)
        elif how < 0.85:  # random bytes or a mutated frame
            frame = encode(model.hostile_request(self.rng))
            self.malformed(sock, random_bytes(self.rng) if how < 0.6 else mutate(frame, self.rng), model)
        else:  # a drop: mid-frame, or with requests in flight
            frames = [encode(model.hostile_request(self.rng)) for _ in range(min(self.rng.randint(1, 6), self.left))]
            if how < 0.95:
                frames[-1] = frames[-1][:self.rng.randrange(len(frames[-1]))]
            self.send(sock, frames)
            self.drop(abort=self.rng.random() < 0.7)

    def malformed(self, sock: socket.socket, blob: bytes, model: SessionModel) -> None:
        """Send ``blob`` and half-close: owed are the replies to the frames the local decoder reads from it,
        then the Error for the frame it refuses, then a close."""
        self.send(sock, [blob])
        half_close(sock)
        messages, tail = decode_all(blob, self.spec.max_frame)
        if all(model.settle(msg, lambda: self.read(sock)) for msg in messages) and isinstance(tail, p.ProtocolError):
            expect_error(self.read(sock), tail.code, None, None)
        self.expect_close(sock)
        self.drop(abort=False)

    # --- connections that never finish a handshake ---
    def side_episode(self) -> None:
        sock, how = self.connect(), self.rng.random()
        hello = p.Hello("head", p.PROTOCOL_VERSION, self.spec.fingerprint, 0, session_id(self.rng))
        abort = True
        try:
            if how < 0.25:
                self.pre_auth(sock, random_bytes(self.rng))
            elif how < 0.55:
                self.pre_auth(sock, mutate(encode(hello), self.rng))
            elif how < 0.8:
                bad = refused_hello(self.spec, self.rng, self.model)
                self.send(sock, [encode(bad)])
                expect_error(self.read(sock), "refused", None, None)
                self.expect_close(sock)
            elif how < 0.9:  # a request before the Hello
                self.send(sock, [encode(self.rng.choice([p.Ping(1), p.Open(0), p.Close(0)]))])
                expect_error(self.read(sock), "bad_header", None, None, "expected Hello first")
                self.expect_close(sock)
            else:  # a Hello cut short, then a reset or a close
                data = encode(hello)
                self.send(sock, [data[:self.rng.randrange(len(data))]])
                abort = self.rng.random() < 0.5
            abort = abort and how >= 0.9
        finally:
            close(sock, abort)

    def pre_auth(self, sock: socket.socket, blob: bytes) -> None:
        """Bytes as a connection's first frame: owed is the Error the local decoder predicts, then a close."""
        self.send(sock, [blob])
        half_close(sock)
        messages, tail = decode_all(blob, PRE_AUTH_FRAME_BYTES)
        if messages and isinstance(messages[0], p.Hello):
            drain(sock)  # a Hello that survived mutation: accepted or refused, any answer will do
            return
        if messages:
            tail = p.ProtocolError("bad_header", "expected Hello first")
        if isinstance(tail, p.ProtocolError):
            expect_error(self.read(sock), tail.code, None, None)
        self.expect_close(sock)


class QuickAck:
    """A socket read with TCP_QUICKACK before every recv, so this end acknowledges at once.

    The worker's accepted sockets keep Nagle's algorithm on, so a second reply sent before the first is
    acknowledged waits for the ACK, which Linux delays up to 40 ms: 44 ms for any two back-to-back replies
    instead of 0.2 ms. Acking at once keeps the fuzz fast (the worker should set TCP_NODELAY; see the report).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def read(self, n: int) -> bytes:
        if hasattr(socket, "TCP_QUICKACK"):
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        return self.sock.recv(n)


def receive(sock: socket.socket) -> p.Message:
    """The next frame from the worker, waiting at most REPLY_TIMEOUT_S (TimeoutError) for it to begin."""
    sock.settimeout(REPLY_TIMEOUT_S)
    return read_message(QuickAck(sock))  # type: ignore[arg-type]


def session_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def half_close(sock: socket.socket) -> None:
    """No more frames from us; the worker may have reset the connection already (it refused the frame)."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def close(sock: socket.socket, abort: bool) -> None:
    """Close; with ``abort`` as a reset (SO_LINGER 0: the worker sees ECONNRESET, no TIME_WAIT here)."""
    if abort:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    sock.close()


def refused_hello(spec: Spec, rng: random.Random, live: SessionModel | None) -> p.Hello:
    """A well-formed Hello this worker must refuse (Error "refused")."""
    session, fp, v = session_id(rng), spec.fingerprint, p.PROTOCOL_VERSION
    choices = [p.Hello("head", v, fp, rng.choice([1, 2, 2**63 - 1]), session),  # another stage
               p.Hello("head", v, "sha256:" + "0" * 64, 0, session),  # another bundle
               p.Hello("upstream", v, fp, 0, session),  # a link for a session nobody opened
               p.Hello("upstream", v, fp, 0, session, "127.0.0.1:1"),  # an upstream naming a next hop
               p.Hello("head", rng.choice([0, v - 1, v + 1, 2**63 - 1]), fp, 0, session)]  # a Hello of another protocol
    if live is not None:
        choices.append(p.Hello("head", v, fp, 0, live.session))  # a session in use
    return rng.choice(choices)


def decode_all(blob: bytes, max_frame: int) -> tuple[list[p.Message], p.ProtocolError | p.ConnectionClosed | None]:
    """The messages the worker's reader finds in ``blob``, and what stops it (None: the blob ended cleanly)."""
    stream, messages = io.BytesIO(blob), []
    while True:
        try:
            messages.append(read_message(stream, max_frame))
        except p.ConnectionClosed as e:
            return messages, (None if e.clean else e)
        except p.ProtocolError as e:
            return messages, e


def drain(sock: socket.socket) -> None:
    try:
        while receive(sock):
            pass
    except (p.ConnectionClosed, p.ProtocolError, OSError):
        pass


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice([rng.randrange(1, 17), rng.randrange(17, 64), rng.randrange(64, 5000)])
    data = rng.randbytes(n)
    if rng.random() < 0.5:  # behind a plausible prefix, so the reader gets past the magic
        data = PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, rng.choice(sorted(p.KINDS)), 0, min(n, 4000), 0) + data
    return data


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """One of: bit flips, a byte replaced, a cut, a length changed (a little or to a huge value), a byte inserted
    or deleted, a prefix field changed, a header field swapped for random JSON."""
    data, how = bytearray(frame), rng.randrange(8)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == 2:
        return bytes(data[:rng.randrange(len(data))])
    elif how == 3:
        at = rng.choice([8, 12])
        old = struct.unpack_from("<I", data, at)[0]
        new = rng.choice([old + rng.randint(-3, 3), rng.getrandbits(32), 2**32 - 1, 64 * 1024 + 1, 2**28])
        struct.pack_into("<I", data, at, max(0, min(new, 2**32 - 1)))
    elif how == 4:
        at = rng.randrange(16, len(data) + 1)
        data[at:at] = bytes([rng.randrange(256)])
    elif how == 5:
        del data[rng.randrange(16, len(data))]
    elif how == 6:
        data[rng.choice([0, 4, 6, 7])] = rng.randrange(256)
    else:
        return swap_field(frame, rng)
    return bytes(data)


def swap_field(frame: bytes, rng: random.Random) -> bytes:
    """The frame with one header field (or one key of its tensor spec) set to a random JSON value."""
    _, _, kind, _, header_len, _ = PREFIX.unpack(frame[:16])
    header, body = json.loads(frame[16:16 + header_len]), frame[16 + header_len:]
    target = header["tensor"] if "tensor" in header and rng.random() < 0.4 else header
    target[rng.choice(sorted(target) + ["extra"])] = rng.choice([
        None, True, -1, 0, 1, 2**31, 2**63, 2**64, 1.5, -0.0, "", "x" * 300, [], [1, 2], {}, {"a": 1},
        [1, 2**31 - 1], "i64", "f64", "argmax", "0" * 32])
    text = json.dumps(header).encode()
    return PREFIX.pack(b"OVSH", p.PROTOCOL_VERSION, kind, 0, len(text), len(body)) + text + body


def run_client(spec: Spec, frames: int, seed: int) -> Counts:
    return Client(spec, frames, seed).run()


class Staller(threading.Thread):
    """Until stopped: a head session sends half a frame and waits for the worker's Error "timeout" and close."""

    def __init__(self, spec: Spec, pid: int | None = None) -> None:
        super().__init__(name="staller", daemon=True)
        self.spec, self.stop, self.counts = spec, threading.Event(), Counts()
        self.pid, self.rss = pid, list[float]()  # the worker's RSS (MB) before each stall

    def run(self) -> None:
        rng = random.Random(0)
        while not self.stop.wait(0.2):
            if self.pid is not None:
                self.rss.append(round(rss_mb(self.pid), 1))
            client = Client(self.spec, 2, rng.getrandbits(32))
            try:
                client.open_session()
                assert client.sock is not None and client.model is not None
                frame = encode(client.model.hostile_request(rng))
                client.send(client.sock, [frame[:rng.randrange(1, len(frame))]])
                start = time.monotonic()
                expect_error(client.read(client.sock), "timeout", None, None)
                waited = time.monotonic() - start
                if not 0.9 * FRAME_TIMEOUT_S <= waited <= 2 * FRAME_TIMEOUT_S + 1:
                    raise Mismatch(f"a stalled frame timed out after {waited:.2f} s (--frame-timeout {FRAME_TIMEOUT_S})")
                client.expect_close(client.sock)
            except Mismatch as e:
                client.fail(f"stall: {e}")
            except ConnectionRefusedError:
                client.fail("stall: the worker refuses connections")
                return
            finally:
                client.drop(abort=False)
                self.counts.add(client.counts)


# ----- the checks after the fuzz -----

def handshake(spec: Spec) -> tuple[socket.socket, p.Message | None]:
    """A head connection with a fresh session, and the worker's answer (None: closed without one)."""
    sock = socket.create_connection(spec.host_port, timeout=REPLY_TIMEOUT_S)
    sock.sendall(encode(p.Hello("head", p.PROTOCOL_VERSION, spec.fingerprint, 0, secrets.token_hex(16))))
    try:
        return sock, receive(sock)
    except (p.ConnectionClosed, ConnectionResetError):
        return sock, None


def capacity(spec: Spec) -> dict[str, int]:
    """Fill the worker through the protocol: MAX_CONNECTIONS head sessions at once (one more turned away),
    then streams over three of them until the worker-wide cap answers busy. Returns how many of each are missing."""
    held: list[socket.socket] = []
    try:
        missing = {"leaked_connections": 0, "leaked_sessions": 0}
        for _ in range(MAX_CONNECTIONS):
            sock, reply = handshake(spec)
            held.append(sock)
            if not isinstance(reply, p.HelloOk):
                missing["leaked_sessions" if isinstance(reply, p.Error) else "leaked_connections"] += 1
        extra, reply = handshake(spec)
        extra.close()
        if reply is not None and not missing["leaked_connections"]:
            raise Mismatch(f"connection {MAX_CONNECTIONS + 1} was answered {reply!r:.200}: the cap is not enforced")
        opened, full = 0, False
        for sock in held[:3]:
            for stream in range(MAX_STREAMS_PER_SESSION):
                sock.sendall(encode(p.Open(stream)))
                reply = receive(sock)
                if reply != p.OpenOk(stream):
                    full = isinstance(reply, p.Error) and reply.code == "busy" and "--max-streams)" in reply.message
                    break
                opened += 1
            if full:
                break
        if not full:
            raise Mismatch(f"{opened} streams opened without the worker-wide cap of {MAX_STREAMS} answering busy")
        return {**missing, "leaked_streams": MAX_STREAMS - opened}
    finally:
        for sock in held:
            sock.close()


def warm_shapes(spec: Spec) -> None:
    """Run a Step of every token count in Spec.tokens once (each from position 0, then a Reset)."""
    sock, reply = handshake(spec)
    try:
        if not isinstance(reply, p.HelloOk):
            raise Mismatch(f"warm-up: expected HelloOk, got {reply!r:.200}")
        sock.sendall(encode(p.Open(0)))
        receive(sock)
        for seq, tokens in enumerate(spec.tokens):
            step = p.Step(0, seq, 0, WANTS[seq % len(WANTS)], p.Tensor.from_array(np.ones((1, tokens), np.int64)))
            sock.sendall(encode(step) + encode(p.Reset(0)))
            receive(sock)
    finally:
        sock.close()


def settled_capacity(spec: Spec, attempts: int = 5) -> dict[str, int]:
    """:func:`capacity`, tried again after a pause while something is missing (the thread of a connection
    closed a moment ago may still be finishing its step)."""
    for _ in range(attempts - 1):
        missing = capacity(spec)
        if not any(missing.values()):
            return missing
        time.sleep(2.0)
    return capacity(spec)


# ----- the run -----

def cached_bundle(root: Path | None = None) -> Path:
    """A one-stage fp32 bundle of stories260K, compiled once into the temp folder and reused while it verifies."""
    from ovshard.bundle.manifest import read_manifest, verify_files

    out = (root or Path(tempfile.gettempdir())) / "ovshard-fuzz" / "stories260K-fp32-1stage"
    try:
        verify_files(out, read_manifest(out), stages=[0])
        return out
    except Exception:  # missing, partial, or from an older ovshard: compile afresh
        pass
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.passes import WeightFormat

    building = out.with_name(f"{out.name}.{os.getpid()}")
    compile_bundle(CompileConfig(STORIES, building, weights=WeightFormat("fp32"), stages=1))
    shutil.rmtree(out, ignore_errors=True)
    try:
        building.rename(out)
    except OSError:  # another run got there first
        shutil.rmtree(building, ignore_errors=True)
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def generate(bundle: Path, address: str) -> list[int]:
    from ovshard.runtime.client.head import Head
    from ovshard.runtime.engine.sampler import SamplingConfig

    head = Head(bundle, [address], timeout=30, retry_s=0)
    try:
        return list(head.generate(PROMPT, SamplingConfig(max_tokens=8)))
    finally:
        head.close()


def run_fuzz(frames: int, seed: int = 0, workers: int = 1, bundle: Path | None = None,
             log: IO[str] | None = None) -> dict:
    """Fuzz one fresh worker process with ``frames`` frames from ``workers`` clients; the report as a dict."""
    bundle = Path(bundle) if bundle is not None else cached_bundle()
    with tempfile.TemporaryDirectory(prefix="ovshard-fuzz-") as tmp, open(Path(tmp) / "worker.log", "w+") as stderr:
        worker = WorkerProcess(serve_command(bundle, 0, "127.0.0.1:0", WORKER_OPTIONS), 0, stderr=stderr)
        try:
            address = worker.wait_listening(120)
            return fuzz(worker, address, bundle, frames, seed, workers, stderr, log or sys.stderr)
        finally:
            worker.stop()


def fuzz(worker: WorkerProcess, address: str, bundle: Path, frames: int, seed: int, workers: int,
         worker_log: IO[str], log: IO[str]) -> dict:
    from ovshard.bundle.manifest import read_manifest

    manifest = read_manifest(bundle)
    host, port = address.rsplit(":", 1)
    spec = Spec((host, int(port)), bundle_fingerprint(bundle), manifest.architecture.vocab_size,
                manifest.runtime_hints.max_positions, manifest.architecture.hidden_size)
    reference = generate(bundle, address)
    warm_shapes(spec)
    warmup = run_client(spec, min(5000, max(frames // 20, 200)), seed ^ 0x5EED)  # every path once, before RSS
    try:
        settled_capacity(spec, attempts=1)  # and every cap filled once
    except (Mismatch, OSError, OvshardError) as e:
        warmup.failures.append({"what": f"capacity check after warm-up: {e}"})
    rss_before = rss_mb(worker.process.pid)
    counts, staller = Counts(), Staller(spec, worker.process.pid)
    staller.start()
    start = time.monotonic()
    if workers == 1:
        counts.add(run_client(spec, frames, seed))
    else:
        shares = [frames // workers + (i < frames % workers) for i in range(workers)]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for part in pool.map(run_client, [spec] * workers, shares, [seed * 1000 + i for i in range(workers)]):
                counts.add(part)
    seconds = time.monotonic() - start
    staller.stop.set()
    staller.join()
    alive = worker.process.poll() is None
    missing = dict.fromkeys(("leaked_connections", "leaked_sessions", "leaked_streams"), -1)
    if alive:
        try:
            missing = settled_capacity(spec)
        except (Mismatch, OSError, OvshardError) as e:
            counts.failures.append({"what": f"capacity check: {e}"})
    same = alive and generate(bundle, address) == reference
    growth = rss_mb(worker.process.pid) - rss_before if alive else float("nan")
    worker_log.flush()
    worker_log.seek(0)
    internal = sum("internal error" in line or "Traceback" in line for line in worker_log)
    failures = warmup.failures + counts.failures + staller.counts.failures
    for failure in failures:
        print(json.dumps(failure), file=log)
    report = {"frames": counts.frames, "seconds": round(seconds, 2), "frames_per_s": round(counts.frames / seconds),
              "connections": counts.connections, "sessions": counts.sessions, "replies": counts.replies,
              "results": counts.results, "errors": dict(sorted(counts.errors.items())),
              "stalls": staller.counts.sessions, "workers": workers, "worker_crashes": int(not alive),
              "same_generation": same, "rss_growth_mb": round(growth, 1),
              "rss_mb": [round(rss_before, 1), *staller.rss[::max(1, len(staller.rss) // 8)]], "internal_errors": internal,
              "failures": len(failures), **missing}
    report["ok"] = bool(alive and same and growth <= RSS_BOUND_MB and not internal and not failures
                        and not any(missing.values()))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--frames", type=int, required=True, help="frames to send in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="client processes (default: one per core but one, at most 16)")
    parser.add_argument("--bundle", type=Path, help="a one-stage bundle (default: stories260K fp32, compiled "
                        "once into the temp folder)")
    args = parser.parse_args(argv)
    os.environ.setdefault("CI", "true")  # no OpenVINO telemetry forks in the worker
    report = run_fuzz(args.frames, args.seed, args.workers, args.bundle)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
