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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ovshard.errors import OvshardError
from ovshard.manifest import read_manifest
from ovshard.runtime import protocol as p
from ovshard.runtime.sampler import (
    SamplingConfig,
    make_rng,
    needs_logits,
    sample,
    sample_from_topk,
    should_stop,
)
from ovshard.runtime.worker import bundle_fingerprint, connect


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float = 0.0
    total_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # head-measured round trip of each step
    stage_s: list[dict[str, float]] = field(default_factory=list)  # each stage's compute per step

    def to_dict(self) -> dict:
        """Decode-phase figures (the first step, the prefill, is in time_to_first_token_s).

        per-hop network ms = (step round trip - sum of stage compute) / hops, hops = stages + 1
        (head -> stage 0 -> ... -> last -> head): transfer, serialisation and waiting.
        """
        decode, stages = self.step_s[1:], self.stage_s[1:]
        report: dict = {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                        "time_to_first_token_s": round(self.first_token_s, 4)}
        if decode:
            compute = [sum(s.values()) for s in stages]
            hops = len(stages[0]) + 1
            report["decode_tokens_per_s"] = round(len(decode) / sum(decode), 2)
            report["mean_step_ms"] = round(1000 * float(np.mean(decode)), 3)
            for name in stages[0]:
                report[f"{name}_compute_ms"] = round(1000 * float(np.mean([s[name] for s in stages])), 3)
            report["per_hop_network_ms"] = round(1000 * float(np.mean(decode) - np.mean(compute)) / hops, 3)
        return report


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

    def step(self, stream: int, position: int, tokens: list[int], want: str) -> p.Result:
        """Send new tokens through the chain; return the last stage's Result."""
        seq = next(self.seq)
        ids = p.Tensor.from_array(np.array([tokens], dtype=np.int64))
        p.write_message(self.socks[0], p.Step(stream, seq, position, (1,) * len(tokens), want, ids))
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

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None) -> Iterator[int]:
        """Yield sampled tokens one by one until an eos id or max_tokens."""
        stats = stats if stats is not None else Stats()
        stream, rng, want = self.open_stream(), make_rng(config), needs_logits(config)
        stats.prompt_tokens = len(prompt)
        start = time.perf_counter()
        tokens: list[int] = []
        position, feed = 0, list(prompt)
        try:
            while True:
                t0 = time.perf_counter()
                result = self.step(stream, position, feed, want)
                stats.step_s.append(time.perf_counter() - t0)
                stats.stage_s.append(dict(result.timings))
                token = self._pick(result, config, rng)
                position += len(feed)
                if not tokens:
                    stats.first_token_s = time.perf_counter() - start
                tokens.append(token)
                stats.new_tokens = len(tokens)
                yield token
                if should_stop(tokens, config):
                    break
                feed = [token]
        finally:
            stats.total_s = time.perf_counter() - start
            self._broadcast(p.Close(stream))

    @staticmethod
    def _pick(result: p.Result, config: SamplingConfig, rng: np.random.Generator) -> int:
        values = result.tensor.to_array()
        if result.indices is not None:  # top-k values [1, 1, K] and their ids
            return sample_from_topk(values[0, -1], result.indices.to_array()[0, -1], config, rng)
        if values.dtype == np.int64:  # argmax ids [1, T]
            return int(values[0, -1])
        return sample(values[0, -1].astype(np.float64), config, rng)  # logits [1, 1, V]
