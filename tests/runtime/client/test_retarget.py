"""The head moved onto another chain mid-stream (what `ovshard up` does when a node leaves): real worker processes
of a 2-stage bundle, then of a 3-stage bundle of the same model; the stream replays onto the new chain and
finishes with the greedy tokens of an uninterrupted run. A refused head ends its streams with the reason."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import compile_fp32, run_greedy

from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import LocalWorkers, local_workers
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.engine.sampler import SamplingConfig

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("retarget")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (2, 3)}


@pytest.mark.parametrize("kv", ["paged", "stateful"])
def test_a_stream_moved_to_another_chain_mid_stream_finishes_with_the_uninterrupted_tokens(
        bundles: dict[int, Path], kv: str) -> None:
    """hold() at token 20, the old workers stopped, retarget() to a 3-stage chain: the stream replays its
    history there (counted in replayed_tokens) and its 60 tokens equal the uninterrupted run."""
    expected = run_greedy(bundles[2], PROMPT, 60)[0]
    with local_workers(bundles[3], exact=True, kv=kv) as new, LocalWorkers(bundles[2], True, kv=kv) as old_workers:
        head = Head(bundles[2], old_workers.addresses, retry_s=5)
        try:
            stats, tokens = Stats(), []
            for token in head.generate(PROMPT, SamplingConfig(max_tokens=60), stats):
                tokens.append(token)
                if len(tokens) == 20:
                    head.hold()
                    old_workers.stop()  # the old chain is gone for good
                    threading.Timer(6.0, head.retarget, (bundles[3], new)).start()  # past retry_s: held
            assert tokens == expected
            assert stats.replays >= 1 and head.retargets == 1 and head.replayed_tokens >= len(PROMPT) + 19
        finally:
            head.close()


def test_a_refused_head_ends_its_waiting_streams_with_the_reason(bundles: dict[int, Path]) -> None:
    """refuse(reason) while a stream waits on a broken chain: the stream fails naming the reason, and so does
    every reconnect until a retarget."""
    with local_workers(bundles[2], exact=True) as addresses:
        head = Head(bundles[2], addresses, retry_s=30)
        try:
            tokens = []
            with pytest.raises(OvshardError, match="node abc lost: 1.2 MiB missing"):
                for token in head.generate(PROMPT, SamplingConfig(max_tokens=60)):
                    tokens.append(token)
                    if len(tokens) == 5:
                        head.hold()
                        head.chain.close()  # the chain breaks while the stages move
                        threading.Timer(0.5, head.refuse, ("node abc lost: 1.2 MiB missing",)).start()
            assert len(tokens) == 5 and head.down == "node abc lost: 1.2 MiB missing"
        finally:
            head.close()
