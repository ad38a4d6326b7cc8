"""Continuous batching over real worker processes: paged stages, one Batch a tick, exact against solo runs."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import compile_fp32, generate_concurrently

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import WorkerProcess, local_workers, serve_command
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.client.streams import StreamLink
from ovshard.runtime.decoding.speculative import make_speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.scheduling.ticks import tick_budget

# Eight prompts of different lengths (one longer than a chunk), and different output lengths
JOBS = (([1, 403, 407, 261, 378], 40), ([1, 365, 261, 466, 14, 92, 388, 17, 261], 25), ([1, 92, 388], 60),
        ([1, 261, 378, 261, 403, 407], 33), ([1, 14, 92], 9), ([1, *range(300, 340)], 30),
        ([1, 403, 407, 261, 378, 403, 407, 261], 70), ([1, 388], 17))


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("batching")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2, 3)}


@pytest.fixture(scope="module")
def solo(bundles: dict[int, Path]) -> list[list[int]]:
    """Each job alone on the stateful in-process path: the reference."""
    from ovshard.runtime.client.inprocess import LocalPipeline

    pipe = LocalPipeline(bundles[1], config=EXACT_HINTS)
    return [list(pipe.generate(prompt, SamplingConfig(max_tokens=n))) for prompt, n in JOBS]


def run_all(head: Head, speculation=None, jobs=JOBS) -> list[list[int]]:
    """Every job at once on its own thread, started together."""
    return generate_concurrently(head, jobs, speculation)


@pytest.mark.parametrize("stages", [2, 3])
def test_eight_batched_streams_each_give_their_solo_tokens(bundles: dict[int, Path], solo: list, stages: int) -> None:
    """8 streams of different prompt and output lengths at once, plain and with prompt lookup, prompts
    chunked over ticks: each stream's greedy tokens are exactly its solo tokens, ticks held several, and
    never more than a group's share, ceil(8 / stages): the groups in flight stay equal."""
    with local_workers(bundles[stages], exact=True, threads=1) as addresses:
        head = Head(bundles[stages], addresses, budget=tick_budget(max_seqs=8, max_chunk=16))
        try:
            engine = head.engine
            assert engine is not None
            sizes: list[int] = []
            send = engine.send
            engine.send = lambda msg: (sizes.append(len(msg.rows)), send(msg))[1]  # the real send, counted
            assert run_all(head) == solo
            stats = engine.stats
            assert stats.seqs > stats.ticks and stats.blocks.used == 0  # ticks of several, every block returned
            assert max(sizes) <= -(-len(JOBS) // stages), sizes
            spec = make_speculation("prompt-lookup", "auto", read_manifest(bundles[stages]))
            assert run_all(head, spec) == solo
        finally:
            head.close()


def test_requests_over_stream_slots_batch_and_a_repeated_prompt_hits_the_prefix_cache(bundles: dict[int, Path],
                                                                                     solo: list) -> None:
    """16 requests over 4 slots (the scheduler of `run` and `api`): all give their solo tokens, and the second
    run of each prompt finds its full blocks cached (prefix hits)."""
    with local_workers(bundles[2], exact=True) as addresses:
        head = Head(bundles[2], addresses)
        session = Scheduler(head, streams=4)
        try:
            requests = [session.submit(prompt, SamplingConfig(max_tokens=n)) for prompt, n in JOBS * 2]
            assert [r.result(timeout=300) for r in requests] == solo * 2
            blocks = head.engine.stats.blocks
            assert blocks.hit_tokens >= 32  # the 41-token prompt's first block, at least, came from the cache
        finally:
            session.close()
            head.close()


def test_a_stage_killed_under_eight_streams_replays_them_all(bundles: dict[int, Path], solo: list) -> None:
    """SIGKILL the middle of three paged stages while 8 streams run and restart it on its port: every stream
    starts again with its history and finishes with its uninterrupted tokens."""
    bundle = bundles[3]
    procs = [WorkerProcess(serve_command(bundle, i, "127.0.0.1:0", ["--exact"]), i, stderr=subprocess.PIPE)
             for i in range(3)]
    try:
        addresses = [w.wait_listening(120) for w in procs]
        head = Head(bundle, addresses, retry_s=120)
        results: list = []
        runner = threading.Thread(target=lambda: results.append(run_all(head)))
        runner.start()
        while head.engine is None or head.engine.stats.ticks < 20:  # well under way
            threading.Event().wait(0.05)
        procs[1].process.kill()
        procs[1].process.wait()
        procs[1] = WorkerProcess(serve_command(bundle, 1, addresses[1], ["--exact"]), 1, stderr=subprocess.PIPE)
        assert procs[1].wait_listening(120) == addresses[1]
        runner.join(timeout=300)
        head.close()
        assert results == [solo] and head.reconnects >= 1
    finally:
        for w in procs:
            w.stop()


def test_stateful_workers_serve_streams_and_a_mixed_chain_is_a_clear_error(bundles: dict[int, Path],
                                                                          solo: list) -> None:
    """Workers started with --kv stateful serve every request through the same engine, each sequence on a
    stream of its own (a StreamLink), with the same tokens, plain and with prompt lookup; every stream is closed once its request ended; a
    chain of one paged and one stateful stage is refused with what to do."""
    with local_workers(bundles[2], exact=True, kv="stateful") as addresses:
        head = Head(bundles[2], addresses)
        try:
            assert isinstance(head.link, StreamLink) and head.engine is not None
            assert run_all(head, jobs=JOBS) == solo
            rewinds: list[int] = []
            conn = head.link.chain.conns[0]
            send = conn.send
            conn.send = lambda msg: (rewinds.append(getattr(msg, "rewind", 0)), send(msg))[1]  # type: ignore[method-assign]  # the real send, counted
            spec = make_speculation("prompt-lookup", "auto", read_manifest(bundles[2]))
            assert run_all(head, spec) == solo
            assert any(rewinds)  # rejected drafts were rewound on their streams
            assert head.engine.stats.ticks > 0
            assert not head.link.streams and not head.link.ticks
        finally:
            head.close()
        paged = WorkerProcess(serve_command(bundles[2], 1, "127.0.0.1:0", ["--exact"]), 1)
        try:
            with pytest.raises(OvshardError, match="same --kv"):
                Head(bundles[2], [addresses[0], paged.wait_listening(120)])
        finally:
            paged.stop()


def test_two_heads_share_the_kv_pool_and_a_dead_heads_blocks_come_back(bundles: dict[int, Path]) -> None:
    """A head asking for the default share gets half a stage's pool, so a second head fits beside it; a third
    that asks for more than is left is refused `busy` with what to do; a head that goes away returns its
    blocks."""
    import secrets

    from ovshard.bundle.manifest import bundle_fingerprint
    from ovshard.runtime.wire.transport import connect

    bundle = bundles[1]
    pool = 64
    worker = WorkerProcess(serve_command(bundle, 0, "127.0.0.1:0", ["--kv-blocks", str(pool)]), 0)
    try:
        address = worker.wait_listening(120)

        def hello(blocks: int):
            return connect(address, 0, bundle_fingerprint(bundle), "head", secrets.token_hex(16), kv_blocks=blocks)

        first, second = hello(0), hello(0)
        assert first.welcome.kv_blocks == second.welcome.kv_blocks == pool // 2
        with pytest.raises(OvshardError, match="0 of 64 blocks free.*--kv-blocks"):
            hello(8)
        first.close()
        deadline = time.monotonic() + 60  # the worker returns the blocks once it sees the connection close
        while True:
            try:
                third = hello(pool // 2)
                break
            except OvshardError:
                assert time.monotonic() < deadline, "the closed head's blocks never came back"
        assert third.welcome.kv_blocks == pool // 2
        second.close()
        third.close()
    finally:
        worker.stop()


def test_prefill_chunk_sets_the_rows_of_a_prompt_a_tick(bundles: dict[int, Path], solo: list) -> None:
    """--prefill-chunk 8 on paged stages: a 41-token prompt goes in 6 ticks (pipelined) with its solo tokens;
    --prefill-chunk 0 sends it in one."""
    prompt, n = JOBS[5]
    with local_workers(bundles[2], exact=True) as addresses:
        for chunk, ticks in ((8, 6), (0, 1)):
            head = Head(bundles[2], addresses, prefill_chunk=chunk)
            try:
                assert list(head.generate(prompt, SamplingConfig(max_tokens=n))) == solo[5]
                assert head.engine.stats.ticks == ticks + n - 1  # the prompt's ticks, then a step a token
            finally:
                head.close()


def test_a_full_kv_pool_preempts_and_every_stream_still_gets_its_solo_tokens(bundles: dict[int, Path]) -> None:
    """8 streams of 100 new tokens over a pool too small to hold them all (16 blocks of 32 positions a stage,
    where they need ~4 each): the newest are preempted and recomputed later, nobody crashes, and every stream
    gives exactly its solo tokens."""
    from ovshard.runtime.client.inprocess import LocalPipeline

    jobs = tuple((prompt, 100) for prompt, _ in JOBS)
    pipe = LocalPipeline(bundles[1], config=EXACT_HINTS)
    alone = [list(pipe.generate(prompt, SamplingConfig(max_tokens=n))) for prompt, n in jobs]
    procs = [WorkerProcess(serve_command(bundles[2], i, "127.0.0.1:0", ["--exact", "--kv-blocks", "16"]), i)
             for i in range(2)]
    try:
        head = Head(bundles[2], [w.wait_listening(120) for w in procs])
        try:
            assert run_all(head, jobs=jobs) == alone
            stats = head.engine.stats
            assert stats.blocks.used == 0 and stats.preemptions > 0
        finally:
            head.close()
    finally:
        for w in procs:
            w.stop()
