"""Chunked prefill over stateful stages: a long prompt goes through the stages a chunk (one Step) a tick.

Two real worker processes (``--kv stateful``, f32 hints), driven by the head's engine through a StreamLink:
with ``--prefill-chunk`` N the prompt's chunks are Steps of consecutive ticks on the sequence's stream,
pipelined over the stages. The outputs equal a one-step prefill's: the same greedy tokens, and the same tokens
of a seeded sampled run (which reads every logit of the last rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import compile_fp32

from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.client.streams import StreamLink
from ovshard.runtime.engine.sampler import SamplingConfig

PROMPT = [1] + [(37 * i) % 500 + 10 for i in range(299)]  # 300 tokens
GREEDY = SamplingConfig(max_tokens=16)
SAMPLED = SamplingConfig(max_tokens=16, temperature=0.8, seed=7)


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("chunked") / "b2", stages=2)


def test_chunked_prefill_equals_one_step(bundle: Path) -> None:
    with local_workers(bundle, exact=True, kv="stateful") as addresses:
        runs, ticks = {}, {}
        for chunk in (0, 64, 100):
            head = Head(bundle, addresses, prefill_chunk=chunk)
            try:
                assert isinstance(head.link, StreamLink) and head.engine is not None
                runs[chunk] = [list(head.generate(PROMPT, config)) for config in (GREEDY, SAMPLED)]
                ticks[chunk] = head.engine.stats.ticks
            finally:
                head.close()
    assert runs[64] == runs[0] and runs[100] == runs[0], runs
    assert len(runs[0][0]) == 16
    # one tick a chunk, then one a token (twice over: greedy, then sampled)
    assert ticks[0] == 2 * 16 and ticks[64] == 2 * (5 + 15) and ticks[100] == 2 * (3 + 15), ticks
