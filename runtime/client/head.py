"""The head: a chain of connections to every stage worker, and what runs requests over it.

It connects to every stage under one fresh session (128 random bits), from the last stage back, and
tells each stage where the next one listens.

Paged stages (the workers' default): the head's :class:`Engine` (scheduling/engine.py), one loop for the
chain, runs every request: it plans a tick of rows of all of them, sends it to stage 0 as one Batch and reads
the last stage's answers, which the chain's reader threads hand it. :meth:`Head.generate` submits one request
and yields its tokens. Stateful stages (``--kv stateful``, or families whose paged form is refused): each stream
has its own InferRequest (KV cache) at every stage and its own decode loop (:class:`StreamTarget`, driven by
decoding/decode.py); a reader thread per connection hands each Result to the step waiting for its ``seq``.

Faults: when a stage goes away (connection lost, or a stage reports it lost the stream or its link), the
engine replays every request (scheduling/engine.py says how) and :class:`StreamTarget` reconnects the whole chain under a new session (retrying with backoff for
``retry_s``), reopens its stream and replays the stream's visible tokens as one prefill, then repeats
the step. The replayed cache holds the same tokens at the same positions, so a greedy stream finishes
with the tokens of an uninterrupted run.

Moves: whoever supervises the stages (``ovshard up``) may :meth:`Head.hold` every reconnect while it places
the stages anew, then :meth:`Head.retarget` the head to the new chain (its own manifest, addresses and
fingerprint; the stale chain is closed, so every stream replays onto the new one with a fresh retry window),
or :meth:`Head.refuse` with the reason the pipeline cannot serve, which ends the waiting streams with it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import Manifest, bundle_fingerprint, read_manifest
from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.client.chain import Chain
from ovshard.runtime.decoding import decode
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.scheduling.engine import Engine, Link
from ovshard.runtime.scheduling.plan_types import BatchConfig, BatchStats
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.scheduling.ticks import batch_config
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.transport import StageUnreachable, connect

log = logging.getLogger(__name__)

RETRY_S = 30.0
_BACKOFF_S = (0.1, 2.0)


# Tokens a prefill Step carries at most; 0: the whole prompt in one Step. Measured (bench/chunked_prefill.py,
# the real Gemma 3 270M, 2 stages, 2,048 tokens): chunks of 128-512 take 4.4x longer to the first token
# than one step, pipelining included: OpenVINO 2026.4's CPU attention over a cache with several new tokens
# (4.6 s for 8 chunks of 256 against 0.8 s for one step of 2,048) and the compressed matmuls, which unpack
# their weights on every call (2.0 s against 0.7 s). So chunking is off by default.
PREFILL_CHUNK = 0
# The planner of a chain of paged stages (scheduling/): up to 32 sequences hold KV blocks at once, and
# a prompt is prefilled in chunks of at most 512 tokens, pipelined over the stages
BATCHING = batch_config(max_seqs=32, max_chunk=512)


def prefill_parts(count: int, chunk: int, want: str) -> list[tuple[int, int, str]]:
    """``[start, end)`` of each chunk of ``count`` new tokens and what to ask of it: one part when ``chunk`` is
    0 or not smaller; every chunk's rows for a bare ``argmax``; else the last chunk holds at least the rows
    ``want`` reads and the others ask for one argmax (their answer is only an acknowledgement)."""
    every_row = want == "argmax"
    needed = p.rows_read(want, count)
    if chunk == 0 or count <= chunk or (needed > chunk and not every_row):
        return [(0, count, want)]  # short, or drafts longer than a chunk: one step
    starts = list(range(0, count, chunk))
    if not every_row and count - starts[-1] < needed:
        starts.pop()  # the last chunk too short for the rows asked: it joins the one before
    ends = [*starts[1:], count]
    return [(a, z, want if every_row or z == count else "argmax@1") for a, z in zip(starts, ends, strict=True)]


def _merged(results: list[p.Result], want: str) -> p.Result:
    """One Result for a chunked step: the last chunk's, with every chunk's rows for a bare argmax."""
    last = results[-1]
    timings: dict[str, float] = {}
    for r in results:
        for stage, seconds in r.timings.items():
            timings[stage] = timings.get(stage, 0.0) + seconds
    tensor = last.tensor
    if want == "argmax":  # every row was asked for: every chunk's
        tensor = p.Tensor.from_array(np.concatenate([r.tensor.to_array() for r in results], axis=1))
    return p.Result(last.stream, last.seq, tensor, timings, last.indices)


def _with_chunk(batching: BatchConfig | None, chunk: int | None, manifest: Manifest) -> BatchConfig | None:
    """The scheduler's settings with a --prefill-chunk the user gave: N rows of a prompt a tick, or (0) the
    whole prompt in one tick."""
    if batching is None or chunk is None:
        return batching
    if chunk == 0:
        return replace(batching, max_chunk=None,
                       token_budget=max(batching.token_budget, manifest.runtime_hints.max_positions))
    return replace(batching, max_chunk=chunk, token_budget=max(batching.token_budget, chunk))


class Head:
    """A chain to every stage of one bundle, reconnected on demand; per-stream bookkeeping.

    Over paged stages every stream's steps are batched (``batching``: the scheduler's settings; None asks no
    KV blocks, for probes) within the ``kv_blocks`` each stage grants this head (0: the stage's default share, half its pool; give
    each head a share when several heads use the same workers)."""

    def __init__(self, bundle: Path, addresses: list[str], timeout: float = 60.0, retry_s: float = RETRY_S,
                 tls: ssl.SSLContext | None = None, prefill_chunk: int | None = None,
                 batching: BatchConfig | None = BATCHING, kv_blocks: int = 0) -> None:
        self.manifest = read_manifest(bundle)
        if len(addresses) != self.manifest.num_stages:
            raise OvshardError(f"--stages names {len(addresses)} addresses; the bundle has "
                               f"{self.manifest.num_stages} stages: give one host:port per stage, in order")
        if retry_s < 0:
            raise OvshardError(f"--retry-s {retry_s}: expected seconds >= 0")
        self.addresses, self.timeout, self.retry_s, self.tls = addresses, timeout, retry_s, tls
        self.fingerprint = bundle_fingerprint(bundle)
        if prefill_chunk is not None and prefill_chunk < 0:
            raise OvshardError(f"--prefill-chunk {prefill_chunk}: expected tokens per prefill step, or 0 for the "
                               f"whole prompt in one step (default: {BATCHING.max_chunk} on paged stages, one step "
                               "on stateful ones)")
        if kv_blocks < 0:
            raise OvshardError(f"--kv-blocks {kv_blocks}: expected the KV blocks to ask each stage for (0: the "
                               "stage's default share)")
        self.batching, self.kv_blocks = _with_chunk(batching, prefill_chunk, self.manifest), kv_blocks
        self.chain = Chain(addresses, self.fingerprint, timeout, tls, self.batching is not None, kv_blocks)
        self.reconnects = 0
        self._reconnect_lock = threading.Lock()
        self._moves = threading.Condition()  # guards held, down, fresh_until, retargets, replayed_tokens
        self.held = False  # a move is under way: reconnects wait for it, their retry windows stopped
        self.down: str | None = None  # why the pipeline cannot serve now (refuse), None while it can
        self.fresh_until = 0.0  # monotonic time up to which a retarget renewed every stream's retry window
        self.retargets = 0  # moves onto a new chain
        self.refusals = 0  # moves that found no chain to serve from (refuse)
        self.replayed_tokens = 0  # tokens fed again to rebuild the KV of streams whose chain broke
        self.streams = itertools.count()
        self.seq = itertools.count()
        self.prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk  # stateful stages
        self.requests = itertools.count()  # numbers Head.generate's requests
        self.engine: Engine | None = None  # the loop over paged stages (None: stateful stages, a stream each)
        if self.batching is not None and self.chain.blocks is not None:
            self.engine = Engine(self, self.chain, self.batching, self.manifest.runtime_hints.max_positions,
                                 self.manifest.architecture.vocab_size, retry_s, timeout)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.chain.close()

    def hold(self) -> None:
        """A move begins: reconnects wait (their retry windows stopped) until :meth:`retarget` or :meth:`refuse`."""
        with self._moves:
            self.held = True

    def retarget(self, bundle: Path, addresses: list[str]) -> None:
        """Serve from now on the chain at ``addresses`` of the pipeline ``bundle`` (the same model placed anew):
        the stale chain is closed, and every stream replays its tokens onto the new one within a fresh
        ``retry_s``."""
        manifest = read_manifest(bundle)
        if len(addresses) != manifest.num_stages:
            raise OvshardError(f"retarget to {len(addresses)} addresses; the pipeline {bundle} has "
                               f"{manifest.num_stages} stages")
        with self._moves:
            self.manifest, self.addresses, self.fingerprint = manifest, list(addresses), bundle_fingerprint(bundle)
            self.held, self.down = False, None
            self.fresh_until = time.monotonic() + self.retry_s
            self.retargets += 1
            stale = self.chain
            self._moves.notify_all()
        stale.close()  # wakes every step waiting on it: each replays onto the new chain

    def refuse(self, reason: str) -> None:
        """The pipeline cannot serve (``reason`` says why); waiting streams end with it until a retarget."""
        with self._moves:
            self.held, self.down = False, reason
            self.refusals += 1
            self._moves.notify_all()
        self.chain.close()

    def expired(self, deadline: float) -> bool:
        """Whether a stream's retry window that ends at ``deadline`` is over (never while a move is under way)."""
        with self._moves:
            return not self.held and time.monotonic() > max(deadline, self.fresh_until)

    def count_replay(self, tokens: int) -> None:
        with self._moves:
            self.replayed_tokens += tokens

    def _await_move(self) -> None:
        """Wait while a move is under way; raise the reason when the pipeline cannot serve."""
        with self._moves:
            while self.held:
                self._moves.wait(1.0)
            if self.down is not None:
                raise OvshardError(self.down)

    def reconnect(self, stale: Link, deadline: float, cause: OvshardError) -> Chain:
        """A new chain in place of ``stale`` (once, however many streams ask), retrying until ``deadline``."""
        with self._reconnect_lock:
            if self.chain is not stale:
                return self.chain
            stale.close()
            pause = _BACKOFF_S[0]
            while True:
                self._await_move()
                try:
                    self.chain = Chain(self.addresses, self.fingerprint, self.timeout, self.tls,
                                       self.batching is not None, self.kv_blocks)
                    self.reconnects += 1
                    log.warning("reconnected to every stage after: %s", cause)
                    return self.chain
                except StageUnreachable as e:
                    if self.expired(deadline - pause):
                        raise OvshardError(f"{cause}; gave up after {self.retry_s:.0f} s of retries "
                                           f"(--retry-s): {e}") from e
                    log.info("stages not reachable yet (%s); retrying in %.1f s", e, pause)
                    time.sleep(pause)
                    pause = min(2 * pause, _BACKOFF_S[1])

    def batch_stats(self) -> BatchStats | None:
        """The engine's planner counters over paged stages (None: stateful stages, no batching)."""
        return None if self.engine is None else self.engine.stats

    def health(self, timeout: float = 2.0) -> list[dict[str, object]]:
        """Each stage's state: "up" with its round-trip ms (a Ping), or "down" with the reason."""
        chain = self.chain
        report: list[dict[str, object]] = []
        for stage, address in enumerate(self.addresses):
            entry: dict[str, object] = {"stage": stage, "address": address}
            nonce = next(self.seq)
            start = time.perf_counter()
            try:
                if chain.broken is None:
                    chain.ask(("ping", nonce), -1, [(stage, p.Ping(nonce))], 1, timeout)
                else:  # the chain is down: probe the stage on its own
                    connect(address, stage, self.fingerprint, "head", secrets.token_hex(16), timeout=timeout,
                            tls=self.tls).close()
                entry.update(state="up", rtt_ms=round(1000 * (time.perf_counter() - start), 3))
            except OvshardError as e:
                entry.update(state="down", error=str(e))
            report.append(entry)
        return report

    def open_stream(self, chain: Chain | None = None) -> tuple[int, Chain]:
        """A new stream, acknowledged by every stage of ``chain`` (default: the current one)."""
        chain = chain or self.chain
        stream = next(self.streams)
        stages = range(len(chain.conns))
        chain.ask(("open", stream), stream, [(i, p.Open(stream)) for i in stages], len(chain.conns))
        return stream, chain

    def close_stream(self, stream: int, chain: Chain) -> None:
        for conn in chain.conns:
            try:
                conn.send(p.Close(stream))
            except OSError:
                pass  # the connection is gone; so is the stream

    def step(self, chain: Chain, stream: int, position: int, tokens: list[int], want: str, rewind: int = 0,
             compact: bool = False) -> p.Result:
        """Send new tokens through the chain; return the last stage's Result. Thread-safe.

        More than ``prefill_chunk`` tokens go as consecutive Steps of a chunk each, all sent at once, so stage
        k computes chunk i while stage k+1 computes chunk i-1 (a pipelined prefill) and no stage holds the
        activations of the whole prompt; the answer is the last chunk's (a bare ``argmax``, which reads
        every row, gets every chunk's rows), with each stage's compute summed over the chunks.
        """
        parts = prefill_parts(len(tokens), self.prefill_chunk, want)
        seqs = [next(self.seq) for _ in parts]
        sends: list[tuple[int, p.Message]] = []
        for n, (seq, (a, z, part_want)) in enumerate(zip(seqs, parts, strict=True)):
            ids = p.Tensor.from_array(np.array([tokens[a:z]], dtype=np.int64))  # [1, T]
            sends.append((0, p.Step(stream, seq, position + a, part_want, ids, {}, rewind if n == 0 else 0,
                                    compact and n == 0)))
        results = [a for (a,) in chain.ask_each([("step", seq) for seq in seqs], stream, sends)
                   if isinstance(a, p.Result)]  # a Step is only ever answered by a Result
        assert len(results) == len(seqs)
        return results[0] if len(results) == 1 else _merged(results, want)

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Generator[int, None, None]:
        """Yield sampled tokens one by one until an eos id or max_tokens: over paged stages one request of the
        engine, paced by this generator's reader; over stateful stages a decode loop on a stream of its own."""
        if self.engine is None:
            target = StreamTarget(self)
            try:
                yield from decode.generate(target, prompt, config, stats, speculation)
            finally:
                target.close()
            return
        request = Request(next(self.requests), list(prompt), config, stats if stats is not None else Stats(),
                          paced=True)
        self.engine.submit(request, speculation)
        try:
            yield from request.tokens()
        finally:
            if not request.done:
                request.cancel()


class StreamTarget:
    """One stream of a Head as a decode target, which survives a stage restart by replaying its tokens."""

    def __init__(self, head: Head) -> None:
        self.head = head
        self.max_positions = head.manifest.runtime_hints.max_positions
        self.vocab_size = head.manifest.architecture.vocab_size
        self.visible: list[int] = []  # the tokens every stage holds as visible, in position order
        self.replays = 0
        self.stream, self.chain = self._open(time.monotonic() + head.retry_s)

    def _open(self, deadline: float) -> tuple[int, Chain]:
        stale = self.head.chain
        while True:
            try:
                return self.head.open_stream(stale)
            except StageFailure as e:
                if not e.recoverable or self.head.expired(deadline):
                    raise
                time.sleep(_BACKOFF_S[0])
                stale = self.head.reconnect(stale, deadline, e)

    def step(self, tokens: list[int], position: int, want: str, rewind: int, compact: bool) -> Scores:
        if rewind:
            del self.visible[len(self.visible) - rewind:]
        deadline: float | None = None
        while True:
            try:
                result = self.head.step(self.chain, self.stream, position, tokens, want, rewind, compact)
                break
            except StageFailure as e:
                if not e.recoverable:
                    raise
                deadline = deadline or time.monotonic() + self.head.retry_s
                self._recover(deadline, e)
                rewind, compact = 0, False  # the replayed cache is exactly self.visible
        self.visible += tokens
        indices = None if result.indices is None else result.indices.to_array()[0]
        return Scores(result.tensor.to_array()[0], indices, dict(result.timings))

    def _recover(self, deadline: float, cause: StageFailure) -> None:
        """Reconnect (if no other stream did yet), reopen this stream, and replay its visible tokens."""
        log.warning("stream %d: %s; reconnecting and replaying %d tokens", self.stream, cause, len(self.visible))
        stale = self.chain
        while True:
            chain = self.head.reconnect(stale, deadline, cause)
            try:
                self.stream, self.chain = self.head.open_stream(chain)
                if self.visible:
                    self.head.step(self.chain, self.stream, 0, self.visible, "argmax@1")
                    self.head.count_replay(len(self.visible))
                self.replays += 1
                return
            except StageFailure as e:
                if not e.recoverable or self.head.expired(deadline):
                    raise OvshardError(f"{cause}; recovery failed: {e}") from e
                cause, stale = e, chain
                time.sleep(_BACKOFF_S[0])

    def close(self) -> None:
        self.head.close_stream(self.stream, self.chain)
