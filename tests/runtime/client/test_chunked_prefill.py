"""Chunked, pipelined prefill: a long prompt goes through the stages a chunk at a time.

Two real worker processes (f32 hints); the head sends every chunk at once, so stage 0 computes chunk i
while stage 1 computes chunk i-1. The outputs equal a one-step prefill's: the same greedy tokens and the
same last-row logits within fp32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32

from ovshard.runtime.client.head import Head, StreamTarget, prefill_parts
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.engine.sampler import SamplingConfig

PROMPT = [1] + [(37 * i) % 500 + 10 for i in range(299)]  # 300 tokens


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("chunked") / "b2", stages=2)


def test_chunked_prefill_equals_one_step(bundle: Path) -> None:
    with local_workers(bundle, exact=True, kv="stateful") as addresses:
        runs, rows = {}, {}
        for chunk in (0, 64, 100):
            head = Head(bundle, addresses, prefill_chunk=chunk)
            try:
                runs[chunk] = list(head.generate(PROMPT, SamplingConfig(max_tokens=16)))
                target = StreamTarget(head)
                scores = target.step(PROMPT, 0, "logits@2", 0, False)
                rows[chunk] = scores.values
                assert scores.values.shape[0] == 2
                bare = target.step([5, 6, 7], len(PROMPT), "argmax", 0, False)  # every row: one step here
                assert bare.values.shape == (3,)
                target.close()
            finally:
                head.close()
    assert runs[64] == runs[0] and runs[100] == runs[0], runs
    assert np.abs(rows[64] - rows[0]).max() < 1e-4 and np.abs(rows[100] - rows[0]).max() < 1e-4


def test_a_bare_argmax_gets_every_chunks_rows(bundle: Path) -> None:
    """``argmax`` without rows reads every fed row: a chunked step answers all of them, as one step does."""
    with local_workers(bundle, exact=True, kv="stateful") as addresses:
        found = {}
        for chunk in (0, 64):
            head = Head(bundle, addresses, prefill_chunk=chunk)
            try:
                target = StreamTarget(head)
                found[chunk] = target.step(PROMPT, 0, "argmax", 0, False).values
                target.close()
            finally:
                head.close()
    assert found[64].shape == (len(PROMPT),) and (found[64] == found[0]).all()


def test_prefill_parts() -> None:
    assert prefill_parts(10, 256, "argmax@1") == [(0, 10, "argmax@1")]
    assert prefill_parts(600, 256, "argmax@1") == [(0, 256, "argmax@1"), (256, 512, "argmax@1"),
                                                   (512, 600, "argmax@1")]
    assert prefill_parts(513, 256, "logits@5") == [(0, 256, "argmax@1"), (256, 513, "logits@5")]
    assert prefill_parts(600, 256, "logits@300") == [(0, 600, "logits@300")]
    assert prefill_parts(600, 0, "argmax@1") == [(0, 600, "argmax@1")]
