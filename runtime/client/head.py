"""The head: a chain of connections to every stage worker, and what runs requests over it.

It connects to every stage under one fresh session (128 random bits), from the last stage back, and
tells each stage where the next one listens.

Every request runs on the head's :class:`Engine` (scheduling/engine.py), one loop for the chain: it plans a tick
of rows of all of them and reads the last stage's answers, which the chain's reader threads hand it. Over paged
stages (the workers' default) a tick is one Batch to stage 0; over stateful stages (``--kv stateful``, or families
whose paged form is refused) the chain is wrapped in a :class:`StreamLink` (client/streams.py), which sends each
row as a Step on its sequence's own stream. :meth:`Head.generate` submits one request and yields its tokens.

Faults: when a stage goes away (connection lost, or a stage reports it lost the stream or its link), the
engine reconnects the whole chain under a new session through :meth:`Head.reconnect` (retrying with backoff for
``retry_s``) and replays every request's history as a new sequence (new streams on stateful stages). The
replayed cache holds the same tokens at the same positions, so a greedy request finishes with the tokens of an
uninterrupted run.

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
from typing import overload

from ovshard.bundle.manifest import Manifest, bundle_fingerprint, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.chain import Chain
from ovshard.runtime.client.streams import StreamLink
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.engine import Engine
from ovshard.runtime.scheduling.links import Link
from ovshard.runtime.scheduling.plan_types import PlannerStats, TickBudget
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.scheduling.ticks import tick_budget
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.transport import StageUnreachable, connect

log = logging.getLogger(__name__)

RETRY_S = 30.0
_BACKOFF_S = (0.1, 2.0)


# The planner's budget over a chain of paged stages (scheduling/): up to 32 sequences hold KV blocks at once,
# and a prompt is prefilled in chunks of at most 512 tokens, pipelined over the stages
BUDGET = tick_budget(max_seqs=32, max_chunk=512)
# Over stateful stages a prompt goes as one Step unless --prefill-chunk says otherwise. Measured
# (bench/batching/chunked_prefill.py, the real Gemma 3 270M, 2 stages, 2,048 tokens): chunks of 128-512 took 4.4x longer
# to the first token than one step, pipelining included: OpenVINO 2026.4's CPU attention over a cache with several
# new tokens, and the compressed matmuls, which unpack their weights on every call.
STATEFUL_CHUNK = 0


@overload
def with_chunk(budget: TickBudget, chunk: int | None, manifest: Manifest) -> TickBudget: ...
@overload
def with_chunk(budget: None, chunk: int | None, manifest: Manifest) -> None: ...
def with_chunk(budget: TickBudget | None, chunk: int | None, manifest: Manifest) -> TickBudget | None:
    """The planner's budget with a --prefill-chunk the user gave: N rows of a prompt a tick, or (0) the
    whole prompt in one tick."""
    if budget is None or chunk is None:
        return budget
    if chunk == 0:
        return replace(budget, max_chunk=None,
                       token_budget=max(budget.token_budget, manifest.runtime_hints.max_positions))
    return replace(budget, max_chunk=chunk, token_budget=max(budget.token_budget, chunk))


def engine_generate(engine: Engine, index: int, prompt: list[int], config: SamplingConfig, stats: Stats,
                    speculation: Speculation | None) -> Generator[int, None, None]:
    """Request ``index`` submitted to ``engine``; its tokens as they are sampled, paced by this generator's
    reader (the next row waits until every token was read); closing the generator early cancels it."""
    request = Request(index, list(prompt), config, stats, paced=True)
    engine.submit(request, speculation)
    try:
        yield from request.tokens()
    finally:
        if not request.done:
            request.cancel()


class Head:
    """A chain to every stage of one bundle, reconnected on demand, and the engine that runs requests over it.

    ``budget``: the planner's tick budget (None: no engine, for probes, which ask no KV blocks). Paged stages
    grant this head ``kv_blocks`` each (0: the stage's default share, half its pool; give each head a share when
    several heads use the same workers); stateful ones a stream per running request (client/streams.py)."""

    def __init__(self, bundle: Path, addresses: list[str], timeout: float = 60.0, retry_s: float = RETRY_S,
                 tls: ssl.SSLContext | None = None, prefill_chunk: int | None = None,
                 budget: TickBudget | None = BUDGET, kv_blocks: int = 0) -> None:
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
                               f"whole prompt in one step (default: {BUDGET.max_chunk} on paged stages, one step "
                               "on stateful ones)")
        if kv_blocks < 0:
            raise OvshardError(f"--kv-blocks {kv_blocks}: expected the KV blocks to ask each stage for (0: the "
                               "stage's default share)")
        self.budget, self.kv_blocks = with_chunk(budget, prefill_chunk, self.manifest), kv_blocks
        self.chain = Chain(addresses, self.fingerprint, timeout, tls, self.budget is not None, kv_blocks)
        self.link = self._link(self.chain)
        if self.budget is not None and prefill_chunk is None and self.chain.blocks is None:
            self.budget = with_chunk(self.budget, STATEFUL_CHUNK, self.manifest)
        self.reconnects = 0
        self._reconnect_lock = threading.Lock()
        self._moves = threading.Condition()  # guards held, down, fresh_until, retargets, replayed_tokens
        self.held = False  # a move is under way: reconnects wait for it, their retry windows stopped
        self.down: str | None = None  # why the pipeline cannot serve now (refuse), None while it can
        self.fresh_until = 0.0  # monotonic time up to which a retarget renewed every stream's retry window
        self.retargets = 0  # moves onto a new chain
        self.refusals = 0  # moves that found no chain to serve from (refuse)
        self.replayed_tokens = 0  # tokens fed again to rebuild the KV of streams whose chain broke
        self.nonces = itertools.count()
        self.requests = itertools.count()  # numbers Head.generate's requests
        self.engine: Engine | None = None  # the loop that runs every request (None: a probe's head)
        if self.budget is not None:
            self.engine = Engine(self, self.link, self.budget, self.manifest.runtime_hints.max_positions,
                                 self.manifest.architecture.vocab_size, retry_s, timeout)

    def _link(self, chain: Chain) -> Link:
        """``chain`` as the engine drives it: itself over paged stages, a StreamLink over stateful ones."""
        if chain.blocks is not None or self.budget is None:
            return chain
        return StreamLink(chain, self.manifest.runtime_hints.max_positions)

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

    def reconnect(self, stale: Link, deadline: float, cause: OvshardError) -> Link:
        """A new chain in place of ``stale`` (once, however often asked), retrying until ``deadline``."""
        with self._reconnect_lock:
            if self.link is not stale:
                return self.link
            stale.close()
            pause = _BACKOFF_S[0]
            while True:
                self._await_move()
                try:
                    self.chain = Chain(self.addresses, self.fingerprint, self.timeout, self.tls,
                                       self.budget is not None, self.kv_blocks)
                    self.link = self._link(self.chain)
                    self.reconnects += 1
                    log.warning("reconnected to every stage after: %s", cause)
                    return self.link
                except StageUnreachable as e:
                    if self.expired(deadline - pause):
                        raise OvshardError(f"{cause}; gave up after {self.retry_s:.0f} s of retries "
                                           f"(--retry-s): {e}") from e
                    log.info("stages not reachable yet (%s); retrying in %.1f s", e, pause)
                    time.sleep(pause)
                    pause = min(2 * pause, _BACKOFF_S[1])

    def planner_stats(self) -> PlannerStats | None:
        """The engine's planner counters (None: a probe's head, no engine)."""
        return None if self.engine is None else self.engine.stats

    def health(self, timeout: float = 2.0) -> list[dict[str, object]]:
        """Each stage's state: "up" with its round-trip ms (a Ping), or "down" with the reason."""
        chain = self.chain
        report: list[dict[str, object]] = []
        for stage, address in enumerate(self.addresses):
            entry: dict[str, object] = {"stage": stage, "address": address}
            nonce = next(self.nonces)
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

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Generator[int, None, None]:
        """Yield sampled tokens one by one until an eos id or max_tokens: one request of the engine, paced by
        this generator's reader."""
        if self.engine is None:
            raise OvshardError("this head was made without a tick budget (a probe): it runs no requests")
        return engine_generate(self.engine, next(self.requests), prompt, config,
                               stats if stats is not None else Stats(), speculation)
