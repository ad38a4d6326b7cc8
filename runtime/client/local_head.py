"""Every stage of a bundle in this process, driven by the engine: the head of ``ovshard run --local`` without workers.

:class:`InProcessLink` is a Link of the engine (scheduling/engine.py) like a chain of workers, with no socket, no
frame and no thread: the engine's thread hands it each tick's Batch and it runs the rows through the stages one
after another, then hands back each wanted row's :class:`~ovshard.runtime.scheduling.engine.Scored` (the Scores
themselves, no Tensor) and the tick's BatchDone. One tick is in flight (``depth`` 1: the stages share the CPU)::

    paged     every stage converted (engine/paged.py): one pool of KV blocks that the engine's block tables name
              directly, as a worker's grant would; a tick of one row and one token runs each stage's copy compiled
              with static shapes (engine/static_step.py); copies of shared blocks are made before the stages run
    one row   a stage on its stateful cache (``--kv stateful``, or a stage whose paged form is refused): a pool of
              one slot of max_positions positions, so the engine runs one sequence at a time; a new sequence
              clears every stage; rewind = the visible positions - the row's position (drafts the accept rule
              rejected), compact when the hidden positions would take the cache past max_positions

:class:`LocalHead` loads the stages, owns the engine and is its host: a failure in this process ends every request
with what went wrong (there is no chain to reconnect). Its engine turns on the thread of the one reader that
:meth:`LocalHead.generate` serves (``Engine.step``: the tick's compute, then its update, then the tokens are
yielded), so a token reaches its reader with no thread in between; with ``background`` (many requests at once: a
Scheduler's) the engine runs on a thread of its own, as over workers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator
from pathlib import Path

import numpy as np

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.client.head import BUDGET, engine_generate, with_chunk
from ovshard.runtime.client.inprocess import OneSequence, load_stages
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.kv import CacheMask, CompactionPolicy
from ovshard.runtime.engine.paged import PagedRows, PagedStage
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.engine.stage import Stage
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.engine import Engine
from ovshard.runtime.scheduling.links import Deliver, Link, Scored
from ovshard.runtime.scheduling.plan_types import PlannerStats, TickBudget
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.wire import protocol as p

IN_PROCESS = "in-process"  # a stage's address where the API's views name one


class InProcessLink:
    """The stages in this process as the engine's Link (the module docstring)."""

    def __init__(self, stages: list[PagedStage | Stage], max_positions: int) -> None:
        self.depth = 1
        self.paged = [s for s in stages if isinstance(s, PagedStage)]
        self.pooled = len(self.paged) == len(stages)
        self.stages = [OneSequence(s) if isinstance(s, PagedStage) else s for s in stages]  # one row's
        self.blocks: BlockManager | None = BlockManager(1, max_positions, prefix_cache=False)
        if self.pooled:
            self.blocks = BlockManager(min(s.num_blocks for s in self.paged), self.paged[0].block_size,
                                       sum(s.bytes_per_token for s in self.paged))
        self.mask = CacheMask()  # one row: a mirror of every stateful stage's mask
        self.policy = CompactionPolicy(limit=max_positions)
        self.seq: int | None = None  # one row: the sequence the stages hold
        self.deliver: Deliver | None = None

    def listen(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def send_tick(self, batch: p.Batch) -> None:
        """Run every row of ``batch`` through the stages now, on the caller's thread; the answers go to the
        listener before this returns. Raises StageFailure (not recoverable) when a stage fails."""
        try:
            outputs, timings = self._run(batch) if self.pooled else self._run_one(batch)
        except (OvshardError, RuntimeError) as e:
            raise StageFailure(f"tick {batch.tick} failed in this process: {e}", recoverable=False) from e
        assert self.deliver is not None, "the engine listens before it sends"
        for row, logits in zip(batch.rows, outputs, strict=True):
            if row.want:
                self.deliver(Scored(batch.tick, row.stream, Scores.from_logits(logits, row.want)))
        self.deliver(p.BatchDone(batch.tick, timings))

    def _run(self, batch: p.Batch) -> tuple[list[np.ndarray], dict[str, float]]:
        """Every row in one inference per paged stage: each stage's output rows, and its seconds."""
        tables = np.split(batch.tables.to_array(), np.cumsum([r.blocks for r in batch.rows])[:-1])
        xs = np.split(batch.tensor.to_array(), np.cumsum([r.count for r in batch.rows])[:-1])
        copies = [] if batch.copies is None else [(int(a), int(b)) for a, b in batch.copies.to_array()]
        wants = [p.rows_read(r.want, r.count) if r.want else 1 for r in batch.rows]
        timings: dict[str, float] = {}
        for i, stage in enumerate(self.paged):
            start = time.perf_counter()
            stage.copy_blocks(copies)
            xs = stage.run([PagedRows(x, row.position, table.tolist(), want if stage.sliced else None)
                            for row, x, table, want in zip(batch.rows, xs, tables, wants, strict=True)])
            timings[f"stage{i}"] = time.perf_counter() - start
        return xs, timings

    def _run_one(self, batch: p.Batch) -> tuple[list[np.ndarray], dict[str, float]]:
        """The tick's one row (a pool of one slot) through every stage, on the stages' own caches."""
        (row,) = batch.rows
        if row.stream != self.seq:  # a new sequence starts at position 0
            self.seq = row.stream
            self.mask.reset()
            for stage in self.stages:
                stage.reset()
        rewind = self.mask.visible - row.position
        self.mask.rewind(rewind)
        compact = self.policy.wants(self.mask, row.count)
        if compact:
            self.mask.compact()
        self.mask.append([1] * row.count)
        x = batch.tensor.to_array()[np.newaxis]  # ids [1, T]
        rows = p.rows_read(row.want, row.count) if row.want else 1
        timings: dict[str, float] = {}
        for i, stage in enumerate(self.stages):
            start = time.perf_counter()
            x = stage.step(x, row.position, rewind, compact, rows)
            timings[f"stage{i}"] = time.perf_counter() - start
        return [x[0]], timings

    def retire(self, seq: int) -> None:
        """Nothing to do: a paged sequence's blocks are the block tables' alone; one row clears at a new one."""

    def close(self) -> None:
        """Nothing to close: the stages go with this object."""


class LocalHead:
    """Every stage of ``bundle`` in this process and the engine over them; ``generate`` as Head's.

    ``paged``: each stage in paged form where it converts (else stateful, logged), one-token ticks on the static
    copy unless ``static_decode`` is False; ``budget``: the planner's settings (a prompt goes whole in one tick
    unless ``prefill_chunk`` says otherwise); ``slots``: sequences the paged pool holds at their full length;
    ``background``: the engine on a thread of its own (a Scheduler's requests), else on generate's reader's."""

    def __init__(self, bundle: str | Path, device: str = "CPU", config: dict[str, str] | None = None,
                 verify: bool = True, cache_dir: Path | None = None, paged: bool = True,
                 static_decode: bool = True, budget: TickBudget = BUDGET, prefill_chunk: int | None = None,
                 slots: int = 1, background: bool = False) -> None:
        self.manifest, stages = load_stages(Path(bundle), device, config, verify, True, cache_dir, paged,
                                            static_decode, slots)
        self.link = InProcessLink(stages, self.manifest.runtime_hints.max_positions)
        chunk = 0 if prefill_chunk is None else prefill_chunk
        self.budget = with_chunk(budget, chunk, self.manifest)
        self.requests = itertools.count()
        self.engine = Engine(self, self.link, self.budget, self.manifest.runtime_hints.max_positions,
                             self.manifest.architecture.vocab_size, retry_s=0.0, timeout=3600.0,
                             background=background)

    # ----- what the API server reads of a head: one process, nothing moves and nothing is reached -----
    down: str | None = None  # a head over workers says here why the chain cannot serve; stages here always can
    retargets = refusals = replayed_tokens = 0  # a head over workers counts its moves and replays

    @property
    def addresses(self) -> list[str]:
        return [IN_PROCESS] * self.manifest.num_stages

    def health(self, timeout: float = 2.0) -> list[dict[str, object]]:
        """Each stage "up" (they are this process's own; a failure ends the requests, not the stages)."""
        return [{"stage": i, "address": IN_PROCESS, "state": "up", "rtt_ms": 0.0}
                for i in range(self.manifest.num_stages)]

    # ----- the engine's host -----
    def reconnect(self, stale: Link, deadline: float, cause: OvshardError) -> Link:
        raise OvshardError(f"{cause} (the stages run in this process: nothing to reconnect)")

    def expired(self, deadline: float) -> bool:
        return True  # no retry window: a failure here would fail again

    def count_replay(self, tokens: int) -> None:
        """Nothing counts replays here: none happen (``expired`` ends a request instead)."""

    # ----- requests -----
    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Generator[int, None, None]:
        """Yield sampled tokens one by one until an eos id or max_tokens (Head.generate's)."""
        stats = stats if stats is not None else Stats()
        stats.hops = 1  # no network: a step's time beyond compute is one "hop" in this process
        if self.engine.thread is not None:
            return engine_generate(self.engine, next(self.requests), prompt, config, stats, speculation)
        return self._stepped(Request(next(self.requests), list(prompt), config, stats), speculation)

    def _stepped(self, request: Request, speculation: Speculation | None) -> Generator[int, None, None]:
        """``request``'s tokens, the engine turned on this thread until it ends; closing early cancels it."""
        delivered: list[int] = []
        request.listener = lambda token: None if token is None else delivered.append(token)
        self.engine.submit(request, speculation)
        try:
            while not request.done:
                if not self.engine.step():
                    raise OvshardError("the local head closed")
                yield from delivered
                delivered.clear()
            yield from delivered
            if request.error is not None:
                raise request.error
        finally:
            if not request.done:
                request.cancel()
                self.engine.step()  # its blocks go back now

    def planner_stats(self) -> PlannerStats:
        return self.engine.stats

    def close(self) -> None:
        self.engine.close()
        self.link.close()

    def __enter__(self) -> LocalHead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
