"""The in-process pipeline on paged stages against the stateful one: same tokens and logits under f32 hints.

Real stories260K bundles compiled fp32 in 1 and 2 stages. A paged stage (engine/paged.py) serves one sequence
whose block table covers max_positions; a rewind is only the next step's position, so speculative decoding
with rejected drafts is the test that matters.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32, refuse_paged_stage

from ovshard import memory
from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client import inprocess
from ovshard.runtime.client.inprocess import LocalPipeline, OneSequence
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import make_speculation
from ovshard.runtime.engine import paged as paged_module
from ovshard.runtime.engine import static_step
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS, Stage

# The first prompt's continuation repeats it, so prompt lookup drafts from the first step on (and is mostly wrong)
PROMPTS = ([1, 403, 407, 261, 378, 259, 403, 407], [1, 365, 261, 466, 14])
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("inprocess")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2)}


def _speculative(pipe: LocalPipeline, bundle: Path, prompt: list[int]) -> tuple[list[int], Stats]:
    """Greedy tokens with prompt lookup (K auto), and the run's stats."""
    stats = Stats()
    spec = make_speculation("prompt-lookup", "auto", read_manifest(bundle), config=EXACT_HINTS)
    return list(pipe.generate(prompt, SamplingConfig(max_tokens=NEW_TOKENS), stats, spec)), stats


@pytest.mark.parametrize("stages", [1, 2])
def test_paged_greedy_equals_stateful(bundles: dict[int, Path], stages: int) -> None:
    """Paged stages choose the stateful stages' greedy tokens from logits within 1e-4, prompt after prompt."""
    stateful = LocalPipeline(bundles[stages], config=EXACT_HINTS)
    paged = LocalPipeline(bundles[stages], config=EXACT_HINTS, paged=True)
    assert all(isinstance(s, OneSequence) for s in paged.stages)
    for prompt in PROMPTS:
        want, want_rows = stateful.generate_greedy(prompt, NEW_TOKENS)
        got, got_rows = paged.generate_greedy(prompt, NEW_TOKENS)
        assert got == want, f"prompt {prompt}"
        np.testing.assert_allclose(np.stack(got_rows), np.stack(want_rows), rtol=0, atol=1e-4)


@pytest.mark.parametrize("stages", [1, 2])
def test_paged_speculation_with_rejected_drafts_equals_stateful(bundles: dict[int, Path], stages: int) -> None:
    """Prompt lookup on paged stages with sliced logits, drafts rejected and rewound: plain greedy's tokens."""
    stateful = LocalPipeline(bundles[stages], config=EXACT_HINTS)
    paged = LocalPipeline(bundles[stages], config=EXACT_HINTS, slice_logits=True, paged=True)
    assert paged.stages[-1].sliced
    for prompt in PROMPTS:
        plain = list(stateful.generate(prompt, SamplingConfig(max_tokens=NEW_TOKENS)))
        got, stats = _speculative(paged, bundles[stages], prompt)
        assert got == plain == _speculative(stateful, bundles[stages], prompt)[0], f"prompt {prompt}"
        if prompt == PROMPTS[0]:
            assert stats.rewinds > 0 and stats.drafted > stats.accepted > 0


@pytest.mark.parametrize(("stages", "hints"), [(1, EXACT_HINTS), (2, EXACT_HINTS), (1, None)])
def test_static_decode_steps_choose_the_dynamic_models_tokens(bundles: dict[int, Path], stages: int,
                                                              hints: dict[str, str] | None) -> None:
    """Every one-token step runs each paged stage's static copy, and it chooses the dynamic model's greedy tokens
    from logits within 1e-4, under f32 hints and under the bundle's own."""
    static = LocalPipeline(bundles[stages], config=hints, slice_logits=True, paged=True)
    dynamic = LocalPipeline(bundles[stages], config=hints, slice_logits=True, paged=True, static_decode=False)
    assert all(s.paged.decode is not None for s in static.stages)
    assert all(s.paged.decode is None for s in dynamic.stages)
    for prompt in PROMPTS:
        before = [s.paged.decode.steps for s in static.stages]
        want, want_rows = dynamic.generate_greedy(prompt, NEW_TOKENS)
        got, got_rows = static.generate_greedy(prompt, NEW_TOKENS)
        assert got == want, f"prompt {prompt}"
        np.testing.assert_allclose(np.stack(got_rows), np.stack(want_rows), rtol=0, atol=1e-4)
        assert [s.paged.decode.steps - b for s, b in zip(static.stages, before, strict=True)] == [NEW_TOKENS] * stages


def test_without_memory_for_a_static_copy_decode_runs_dynamic(bundles: dict[int, Path],
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Where the memory available cannot hold a static copy, none is made (logged at INFO) and decode still
    chooses the stateful tokens."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 0)
    with caplog.at_level(logging.INFO, logger=paged_module.__name__):
        pipe = LocalPipeline(bundles[1], config=EXACT_HINTS, slice_logits=True, paged=True)
    assert pipe.stages[0].paged.decode is None
    assert "too little memory available for a static copy" in caplog.text
    want, _ = LocalPipeline(bundles[1], config=EXACT_HINTS).generate_greedy(PROMPTS[1], 16)
    assert pipe.generate_greedy(PROMPTS[1], 16)[0] == want


def test_a_stage_refused_in_paged_form_runs_stateful(bundles: dict[int, Path], monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A stage whose paged form is refused runs stateful beside a paged one (rows converted at the boundary),
    the reason logged at INFO; speculation with rewinds still gives the stateful tokens."""
    refuse_paged_stage(monkeypatch, 1)
    with caplog.at_level(logging.INFO, logger=inprocess.__name__):
        mixed = LocalPipeline(bundles[2], config=EXACT_HINTS, slice_logits=True, paged=True)
    assert [type(s) for s in mixed.stages] == [OneSequence, Stage]
    assert "stage 1: stateful KV cache" in caplog.text and "refused for the test" in caplog.text
    stateful = LocalPipeline(bundles[2], config=EXACT_HINTS)
    got, stats = _speculative(mixed, bundles[2], PROMPTS[0])
    assert got == list(stateful.generate(PROMPTS[0], SamplingConfig(max_tokens=NEW_TOKENS)))
    assert stats.rewinds > 0


def test_in_process_stats_count_one_hop(bundles: dict[int, Path]) -> None:
    """In this process per_hop_network_ms is all a decode step costs beyond the stages' compute."""
    stats = Stats()
    pipe = LocalPipeline(bundles[2], config=EXACT_HINTS, paged=True)
    list(pipe.generate(PROMPTS[1], SamplingConfig(max_tokens=8), stats))
    report = stats.to_dict()
    beyond = report["mean_step_ms"] - report["stage0_compute_ms"] - report["stage1_compute_ms"]
    assert report["per_hop_network_ms"] == pytest.approx(beyond, abs=0.01)


def test_a_stage_past_the_size_cap_gets_no_static_copy() -> None:
    """A stage whose step is long (more weights than the cap) is refused a copy whatever the memory, a small one is
    given one where memory allows."""
    assert "would not pay" in (static_step.why_no_copy(static_step.COPY_MAX_BYTES + 1) or "")
    assert static_step.why_no_copy(1 << 20) is None or "too little memory" in static_step.why_no_copy(1 << 20)
