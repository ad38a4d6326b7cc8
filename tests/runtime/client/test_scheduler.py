"""Concurrent user streams: isolation over real worker processes, sibling InferRequests on CPU, the
--prompts-file command, and the pipeline behind the delaying proxy."""

from __future__ import annotations

import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32, generate_concurrently

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import LocalWorkers, local_workers
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.decoding.speculative import make_speculation
from ovshard.runtime.engine.kv import step_inputs
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.tools.wanproxy import DelayProxy

# Different prompts and lengths; each stream's tokens must be those it gets alone.
JOBS = (([1, 403, 407, 261, 378], 40), ([1, 365, 261, 466, 14, 92, 388, 17, 261], 25),
        ([1, 92, 388], 60), ([1, 261, 378, 261, 403, 407], 33))


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("streams")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2, 3)}


@pytest.fixture(scope="module")
def alone(bundles: dict[int, Path]) -> list[list[int]]:
    """Each job run by itself on one stream: the reference."""
    from ovshard.runtime.client.inprocess import LocalPipeline

    pipe = LocalPipeline(bundles[1], config=EXACT_HINTS)
    return [list(pipe.generate(prompt, SamplingConfig(max_tokens=n))) for prompt, n in JOBS]


def _run_concurrently(head: Head, speculation=None) -> list[list[int]]:
    return generate_concurrently(head, JOBS, speculation, timeout=120)


@pytest.mark.parametrize("stages", [2, 3])
def test_four_concurrent_streams_equal_running_alone(bundles: dict[int, Path], alone: list, stages: int) -> None:
    """4 streams at once through worker processes (plain, then with prompt lookup): each stream's
    greedy tokens are exactly those it produces alone."""
    with local_workers(bundles[stages], exact=True, threads=1) as addresses:
        head = Head(bundles[stages], addresses)
        try:
            assert _run_concurrently(head) == alone
            spec = make_speculation("prompt-lookup", "auto", read_manifest(bundles[stages]))
            assert _run_concurrently(head, spec) == alone
        finally:
            head.close()


def test_session_queues_more_requests_than_streams(bundles: dict[int, Path], alone: list) -> None:
    """8 requests over 2 streams: all finish, in any order, each with its own tokens."""
    with local_workers(bundles[2], exact=True) as addresses:
        head = Head(bundles[2], addresses)
        session = Scheduler(head, streams=2)
        try:
            requests = [session.submit(prompt, SamplingConfig(max_tokens=n)) for prompt, n in JOBS * 2]
            streamed = list(requests[0].tokens())
            assert [r.result(timeout=120) for r in requests] == alone * 2
            assert streamed == alone[0]
        finally:
            session.close()
            head.close()


def test_a_dead_stage_fails_every_waiting_stream(bundles: dict[int, Path]) -> None:
    """A worker killed while 4 streams run: every request ends with an error naming the stage; none hangs."""
    with LocalWorkers(bundles[2], exact=True) as workers:
        head = Head(bundles[2], workers.addresses, timeout=30, retry_s=1)
        session = Scheduler(head, streams=4)
        requests = [session.submit([1, 403], SamplingConfig(max_tokens=400)) for _ in range(4)]
        next(requests[0].tokens())
        workers.processes[1].kill()
        for r in requests:
            with pytest.raises(OvshardError, match="stage 1"):
                r.result(timeout=60)
        session.close()
        head.close()


def test_concurrent_reset_state_on_sibling_requests_is_safe_on_cpu(bundles: dict[int, Path]) -> None:
    """The paper saw corrupted shapes calling reset_state concurrently on sibling InferRequests (GPU,
    OpenVINO 2026.1-2026.2). On CPU with this OpenVINO: 4 threads, one compiled model, reset + infer of
    random lengths, every output equal to the single-threaded reference. (It holds: no guard needed.)"""
    manifest = read_manifest(bundles[1])
    compiled = ov.Core().compile_model(str(bundles[1] / manifest.stages[0].model_xml), "CPU", EXACT_HINTS)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 512, size=(1, int(n))) for n in rng.integers(1, 40, size=12)]

    def run(request: ov.InferRequest, x: np.ndarray) -> np.ndarray:
        request.reset_state()
        request.infer(step_inputs("input_ids", x, [1] * x.shape[1], 0, 512))
        return request.infer(step_inputs("input_ids", x[:, :1], [1] * (x.shape[1] + 1), x.shape[1], 512))[
            compiled.output(0)].copy()

    reference = [run(compiled.create_infer_request(), x) for x in seqs]
    bad: list[tuple[int, int]] = []

    def hammer(seed: int) -> None:
        request, r = compiled.create_infer_request(), np.random.default_rng(seed)
        for _ in range(60):
            i = int(r.integers(len(seqs)))
            out = run(request, seqs[i])
            if out.shape != reference[i].shape or float(np.abs(out - reference[i]).max()) > 1e-5:
                bad.append((seed, i))

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_prompts_file_over_streams(bundles: dict[int, Path], tmp_path: Path) -> None:
    """`ovshard run --prompts-file F --streams 2` prints every completion once, each under its prompt's header
    (in the order they finish: tests/e2e/test_chat_command.py checks that order)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe little dog\nTom and Sue went\n")
    cmd = [sys.executable, "-m", "ovshard.cli", "run", str(bundles[2]), "--local", "--exact", "--threads", "1",
           "--prompts-file", str(prompts), "--streams", "2", "--max-tokens", "12", "--stats", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stdout.splitlines() if line.startswith("=== [")]
    assert sorted(heads) == ["=== [0] Once upon a time", "=== [1] The little dog", "=== [2] Tom and Sue went"]
    assert '"prompts": 3' in done.stderr and '"streams": 2' in done.stderr and '"failed": 0' in done.stderr
    prompts.write_text("\n\n")
    empty = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert empty.returncode != 0 and "has no prompts" in empty.stderr and "Traceback" not in empty.stderr


def test_pipeline_behind_delaying_proxies(bundles: dict[int, Path], alone: list) -> None:
    """Each stage behind a 5 ms proxy (head -> 0 -> 1 -> head all delayed): same tokens, bytes relayed."""
    with local_workers(bundles[2], exact=True) as addresses, ExitStack() as stack:
        proxies = []
        for address in addresses:
            host, port = address.rsplit(":", 1)
            proxies.append(stack.enter_context(DelayProxy(target=(host, int(port)), latency_s=0.005)))
        head = Head(bundles[2], [proxy.address for proxy in proxies])
        try:
            prompt, n = JOBS[0]
            assert list(head.generate(prompt, SamplingConfig(max_tokens=n))) == alone[0]
        finally:
            head.close()
        assert proxies[1].bytes_up > 0 and proxies[1].bytes_down > 0


def test_a_short_request_is_not_held_up_by_a_long_one(bundles: dict[int, Path]) -> None:
    """Fair scheduling: submitted together on 2 streams, a 200-token request and a 10-token one take turns at
    every stage, so every token of the short one arrives before the long one is half way (a scheduler that ran
    requests one after the other, or favoured the first, would give the long one 200 or ~190 tokens first)."""
    events: list[str] = []  # "long" / "short" per token, in the order the listeners heard them
    lock = threading.Lock()

    def heard(which: str):
        def listener(token: int | None) -> None:
            if token is not None:
                with lock:
                    events.append(which)
        return listener

    with local_workers(bundles[2], exact=True) as addresses:
        head = Head(bundles[2], addresses)
        session = Scheduler(head, streams=2)
        try:
            long = session.submit([1, 403, 407], SamplingConfig(max_tokens=200), heard("long"))
            short = session.submit([1, 92, 388], SamplingConfig(max_tokens=10), heard("short"))
            assert len(short.result(timeout=300)) == 10 and len(long.result(timeout=300)) == 200
        finally:
            session.close()
            head.close()
    last_short = max(i for i, which in enumerate(events) if which == "short")
    assert events[:last_short].count("long") < 100, events[:last_short]
