"""`ovshard api` under a crowd and at its limits: admission by KV memory, the queue, 429 with Retry-After,
clients that go away; the official `openai` client against real processes."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from api_server import Api, api, idle, until
from conftest import at_once, compile_fp32

CROWD, TOKENS = 64, 32
PROMPTS = ["Once upon a time", "The cat", "Lily saw", "One day", "Tom had a", "The sun"]
MB = 1 << 20


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("limits") / "stories", stages=2)


@pytest.fixture(scope="module")
def limited(bundle: Path) -> Iterator[Api]:
    """One request at a time, two waiting, each step ~0.1 s (delayed links): a request holds its place for seconds."""
    with api(bundle, "--streams", "1", "--queue", "2", delay_s=0.02) as running:
        yield running


def streamed(client: openai.OpenAI, i: int) -> tuple[str, float]:
    """Crowd member ``i``, streamed: (its finish reason, or "dropped" for every 4th, which goes away after 3
    chunks, or the error's name; seconds)."""
    start = time.perf_counter()
    try:
        stream = client.completions.create(model="stories", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=TOKENS,
                                           temperature=0, stream=True)
        finish = "none"
        for n, chunk in enumerate(stream, 1):
            if i % 4 == 3 and n == 3:
                stream.close()
                return "dropped", time.perf_counter() - start
            finish = chunk.choices[0].finish_reason or finish
        return finish, time.perf_counter() - start
    except openai.APIError as e:
        return type(e).__name__, time.perf_counter() - start


def footprint(pid: int) -> tuple[list[int], int]:
    """RSS of the API process and of each of its workers, and the API process's threads."""
    head = psutil.Process(pid)
    return [p.memory_info().rss for p in (head, *head.children())], head.num_threads()


@pytest.fixture(scope="module")
def one_stage(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("limits1") / "stories", stages=1)


@pytest.mark.parametrize("where", ["workers", "in-process"])
def test_a_crowd_is_served_in_turn_by_memory_and_leaves_nothing_behind(where: str, request: pytest.FixtureRequest) -> None:
    """64 streaming clients at once against `ovshard api --local`'s defaults, every 4th going away mid-stream: every
    kept one ends with stop or length, none is refused, the slowest takes at most 3x the median; then no KV block,
    request or sequence is held, no thread is left, and each process's RSS is within 64 MB of a warm-up's. Over
    two stage workers, and over a one-stage bundle's stage in the server's own process."""
    bundle = request.getfixturevalue("bundle" if where == "workers" else "one_stage")
    with api(bundle, local=True) as server:
        assert {finish for finish, _ in at_once(lambda i: streamed(server.client, i), list(range(8)))} \
            <= {"stop", "length", "dropped"}
        rss, threads = footprint(server.process.pid)
        results = at_once(lambda i: streamed(server.client, i), list(range(CROWD)), 120)
        finishes = [finish for finish, _ in results]
        assert set(finishes) <= {"stop", "length", "dropped"}, finishes
        assert finishes.count("dropped") == CROWD // 4
        kept = [seconds for finish, seconds in results if finish != "dropped"]
        assert max(kept) <= 3 * statistics.median(kept), sorted(kept)
        seen = until(idle, server.url)
        assert idle(seen), seen
        now, now_threads = footprint(server.process.pid)
        assert all(b - a < 64 * MB for a, b in zip(rss, now, strict=True)), (rss, now)
        assert now_threads <= threads + min(32, (os.cpu_count() or 1) + 4)  # at most asyncio's to_thread pool more


def hold(server: Api, tokens: int = 400) -> openai.Stream:
    """A streamed request that has begun (its first chunk read) and goes on for ``tokens``."""
    stream = server.client.completions.create(model="stories", prompt="Once upon a time", max_tokens=tokens,
                                              temperature=0, stream=True)
    next(iter(stream))
    return stream


def test_past_the_queue_the_user_set_requests_get_429_with_retry_after(limited: Api) -> None:
    """With --streams 1 --queue 2, one runs and two wait; the next gets 429 with a Retry-After of whole seconds
    (at least 1) and an OpenAI error body; once they end, requests are served again."""
    streams = [hold(limited) for _ in range(3)]
    try:
        assert until(lambda m: m["ovshard_queue_depth"] == 2, limited.url)["ovshard_active_streams"] == 1
        with pytest.raises(openai.RateLimitError) as refused:
            limited.client.completions.create(model="stories", prompt="The cat", max_tokens=5)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        error = refused.value.response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "busy", None)
        assert "busy" in error["message"] and "try again in" in error["message"]
    finally:
        for stream in streams:
            stream.close()
    assert idle(until(idle, limited.url))
    assert limited.client.completions.create(model="stories", prompt="The cat", max_tokens=3).choices[0].text


def test_clients_that_go_away_leave_the_queue_and_free_their_blocks(limited: Api) -> None:
    """A running non-streamed client that goes away frees its KV blocks at once; with another running, a waiting
    non-streamed client and a waiting streamed one that go away leave the queue at once; nothing is held after."""
    impatient = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="none", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):  # 400 tokens would take tens of seconds here
        impatient.completions.create(model="stories", prompt="Once upon a time", max_tokens=400)
    assert idle(until(idle, limited.url, 5))
    running = hold(limited)
    try:
        waiting = hold(limited)  # its first chunk comes at once: the role, before any token
        assert until(lambda m: m["ovshard_queue_depth"] == 1, limited.url)["ovshard_queue_depth"] == 1
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="stories", prompt="The cat", max_tokens=5)
        assert until(lambda m: m["ovshard_queue_depth"] == 1, limited.url, 5)["ovshard_queue_depth"] == 1
        waiting.close()
        seen = until(lambda m: m["ovshard_queue_depth"] == 0, limited.url, 5)
        assert (seen["ovshard_queue_depth"], seen["ovshard_active_streams"]) == (0, 1)
        assert seen["ovshard_kv_blocks{state=used}"] > 0
    finally:
        running.close()
    assert idle(until(idle, limited.url))
