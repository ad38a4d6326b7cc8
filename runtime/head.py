"""The head: drives one or more streams through a chain of stage workers and samples tokens.

It connects to every stage (handshake: protocol, bundle fingerprint, stage index), tells each stage
where the next one listens, then for every step sends the new tokens to stage 0 and waits for the
last stage's Result. Only the mask *delta* travels; the stages keep the mask.

Streams: each stream has its own InferRequest (KV cache) at every stage, all from the stage's one
compiled model. Any number of threads may call :meth:`Head.step` / :meth:`Head.generate` at once,
one stream each: a reader thread per connection hands each Result to the step waiting for its
``seq``, and no lock is held while waiting. A stream has at most one step in flight and every stage
serves steps in arrival order, so the streams share each stage round-robin; while stage 1 computes
stream A's step, stage 0 already computes stream B's.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime import decode
from ovshard.runtime import protocol as p
from ovshard.runtime.decode import Stats
from ovshard.runtime.sampler import SamplingConfig
from ovshard.runtime.scores import Scores
from ovshard.runtime.speculative import Speculation
from ovshard.runtime.transport import Connection, bundle_fingerprint, connect

Answer = p.Result | OvshardError  # what a waiting step is handed: its Result, or why it will not come


class Head:
    """Connections to every stage of one bundle, and the per-stream bookkeeping."""

    def __init__(self, bundle: Path, addresses: list[str], timeout: float = 60.0) -> None:
        self.manifest = read_manifest(bundle)
        if len(addresses) != self.manifest.num_stages:
            raise OvshardError(f"--stages names {len(addresses)} addresses; the bundle has "
                               f"{self.manifest.num_stages} stages: give one host:port per stage, in order")
        self.addresses, self.timeout = addresses, timeout
        fingerprint = bundle_fingerprint(bundle)
        # connect from the last stage back, so each stage's next hop already listens when it is named
        self.conns: list[Connection] = []
        try:
            for i in reversed(range(len(addresses))):
                nxt = addresses[i + 1] if i + 1 < len(addresses) else None
                self.conns.insert(0, connect(addresses[i], i, fingerprint, "head", nxt, timeout))
        except OvshardError:
            self.close()
            raise
        self.lock = threading.Lock()  # guards waiting and broken
        # seq -> (stream, where its answer goes)
        self.waiting: dict[int, tuple[int, queue.Queue[Answer]]] = {}
        self.broken: OvshardError | None = None
        for i, conn in enumerate(self.conns):
            threading.Thread(target=self._read, args=(i, conn), daemon=True).start()
        self.streams = itertools.count()
        self.seq = itertools.count()

    def _read(self, stage: int, conn: Connection) -> None:
        """Route each answer to the step waiting for it; a failed connection fails every waiting step."""
        where = f"stage {stage} at {self.addresses[stage]}"
        try:
            while True:
                msg = conn.receive()
                answer: Answer
                with self.lock:
                    if isinstance(msg, p.Result):
                        answer = msg
                        targets = [self.waiting[msg.seq][1]] if msg.seq in self.waiting else []
                    elif isinstance(msg, p.Error):
                        answer = OvshardError(f"{where} reported {msg.code}: {msg.message}")
                        targets = [q for s, q in self.waiting.values() if msg.stream in (None, s)]
                    else:
                        continue  # nothing else is addressed to the head
                for target in targets:
                    target.put(answer)
        except (p.ConnectionClosed, p.ProtocolError, OSError) as e:
            with self.lock:
                self.broken = OvshardError(f"{where} closed the connection: {e}")
                for _, target in self.waiting.values():
                    target.put(self.broken)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def _broadcast(self, msg: p.Message) -> None:
        for conn in self.conns:
            conn.send(msg)

    def open_stream(self) -> int:
        stream = next(self.streams)
        self._broadcast(p.Open(stream))
        return stream

    def close_stream(self, stream: int) -> None:
        try:
            self._broadcast(p.Close(stream))
        except OSError:
            pass  # the connection is gone; so is the stream

    def step(self, stream: int, position: int, tokens: list[int], want: str, rewind: int = 0,
             compact: bool = False) -> p.Result:
        """Send new tokens through the chain; return the last stage's Result. Thread-safe."""
        seq = next(self.seq)
        answer: queue.Queue[Answer] = queue.Queue()
        with self.lock:
            if self.broken is not None:
                raise self.broken
            self.waiting[seq] = (stream, answer)
        try:
            ids = p.Tensor.from_array(np.array([tokens], dtype=np.int64))
            self.conns[0].send(p.Step(stream, seq, position, (1,) * len(tokens), want, ids, {}, rewind, compact))
            try:
                msg = answer.get(timeout=self.timeout)
            except queue.Empty:
                raise OvshardError(f"no result for step {seq} of stream {stream} within {self.timeout:.0f} s "
                                   f"(stages {', '.join(self.addresses)})") from None
        finally:
            with self.lock:
                self.waiting.pop(seq, None)
        if isinstance(msg, Exception):
            raise msg
        return msg

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Iterator[int]:
        """Yield sampled tokens one by one until an eos id or max_tokens, on a stream of its own."""
        stream = self.open_stream()
        try:
            yield from decode.generate(StreamTarget(self, stream), prompt, config, stats, speculation)
        finally:
            self.close_stream(stream)


class StreamTarget:
    """One stream of a Head as a decode target."""

    def __init__(self, head: Head, stream: int) -> None:
        self.head, self.stream = head, stream
        self.max_positions = head.manifest.runtime_hints.max_positions
        self.vocab_size = head.manifest.architecture.vocab_size

    def step(self, tokens: list[int], position: int, want: str, rewind: int, compact: bool) -> Scores:
        result = self.head.step(self.stream, position, tokens, want, rewind, compact)
        indices = None if result.indices is None else result.indices.to_array()[0]
        return Scores(result.tensor.to_array()[0], indices, dict(result.timings))
