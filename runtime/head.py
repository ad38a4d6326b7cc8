"""The head: drives one or more streams through a chain of stage workers and samples tokens.

It connects to every stage (handshake: protocol, bundle fingerprint, stage index), tells each stage
where the next one listens, then for every step sends the new tokens to stage 0 and waits for the
last stage's Result. Only the mask *delta* travels; the stages keep the mask.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ovshard.errors import OvshardError
from ovshard.manifest import read_manifest
from ovshard.runtime import decode
from ovshard.runtime import protocol as p
from ovshard.runtime.decode import Scores, Stats
from ovshard.runtime.sampler import SamplingConfig
from ovshard.runtime.speculative import Speculation
from ovshard.runtime.worker import bundle_fingerprint, connect


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
        self.socks: list[socket.socket] = [None] * len(addresses)  # type: ignore[list-item]
        for i in reversed(range(len(addresses))):
            nxt = addresses[i + 1] if i + 1 < len(addresses) else None
            self.socks[i] = connect(addresses[i], i, fingerprint, "head", nxt, timeout)
        self.inbox: queue.Queue = queue.Queue()
        for i, sock in enumerate(self.socks):
            threading.Thread(target=self._read, args=(i, sock), daemon=True).start()
        self.streams = itertools.count()
        self.seq = itertools.count()

    def _read(self, stage: int, sock: socket.socket) -> None:
        try:
            while True:
                self.inbox.put((stage, p.read_message(sock)))
        except (p.ConnectionClosed, p.ProtocolError, OSError) as e:
            self.inbox.put((stage, e))

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    def _broadcast(self, msg: p.Message) -> None:
        for sock in self.socks:
            p.write_message(sock, msg)

    def open_stream(self) -> int:
        stream = next(self.streams)
        self._broadcast(p.Open(stream))
        return stream

    def step(self, stream: int, position: int, tokens: list[int], want: str, rewind: int = 0,
             compact: bool = False) -> p.Result:
        """Send new tokens through the chain; return the last stage's Result."""
        seq = next(self.seq)
        ids = p.Tensor.from_array(np.array([tokens], dtype=np.int64))
        p.write_message(self.socks[0], p.Step(stream, seq, position, (1,) * len(tokens), want, ids, {}, rewind,
                                              compact))
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                stage, msg = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise OvshardError(f"no result for step {seq} within {self.timeout:.0f} s "
                                   f"(stages {', '.join(self.addresses)})") from None
            where = f"stage {stage} at {self.addresses[stage]}"
            if isinstance(msg, Exception):
                raise OvshardError(f"{where} closed the connection: {msg}")
            if isinstance(msg, p.Error):
                raise OvshardError(f"{where} reported {msg.code}: {msg.message}")
            if isinstance(msg, p.Result) and msg.seq == seq:
                return msg

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Iterator[int]:
        """Yield sampled tokens one by one until an eos id or max_tokens, on a stream of its own."""
        stream = self.open_stream()
        try:
            yield from decode.generate(StreamTarget(self, stream), prompt, config, stats, speculation)
        finally:
            self._broadcast(p.Close(stream))


class StreamTarget:
    """One stream of a Head as a decode target."""

    def __init__(self, head: Head, stream: int) -> None:
        self.head, self.stream = head, stream
        self.max_positions = int(head.manifest.runtime_hints["max_positions"])
        self.vocab_size = int(head.manifest.architecture["vocab_size"])

    def step(self, tokens: list[int], position: int, want: str, rewind: int, compact: bool) -> Scores:
        result = self.head.step(self.stream, position, tokens, want, rewind, compact)
        indices = None if result.indices is None else result.indices.to_array()[0]
        return Scores(result.tensor.to_array()[0], indices, dict(result.timings))
