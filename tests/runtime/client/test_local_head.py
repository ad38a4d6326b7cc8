"""The engine over the stages in this process (client/local_head.py): what `ovshard run --local` runs without workers.

Real stories260K bundles compiled fp32 in 1 and 2 stages under f32 hints; the reference is LocalPipeline's
stateful greedy loop (client/inprocess.py), which shares no code with the engine past the stages themselves.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import compile_fp32, refuse_paged_stage

from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client import inprocess
from ovshard.runtime.client.inprocess import LocalPipeline, OneSequence
from ovshard.runtime.client.local_head import LocalHead
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import make_speculation
from ovshard.runtime.engine.paged import PagedStage
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS, Stage

# The first prompt's continuation repeats it, so prompt lookup drafts from the first step on (and is mostly wrong)
PROMPTS = ([1, 403, 407, 261, 378, 259, 403, 407], [1, 365, 261, 466, 14], [1, 365, 261, 466, 14, 261, 378])
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("local-head")
    return {n: compile_fp32(stories, root / f"b{n}", stages=n) for n in (1, 2)}


@pytest.fixture(scope="module")
def reference(bundles: dict[int, Path]) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from the stateful stages' own loop (the bundles' stages agree: same weights)."""
    pipe = LocalPipeline(bundles[2], config=EXACT_HINTS)
    return {tuple(prompt): pipe.generate_greedy(prompt, NEW_TOKENS)[0] for prompt in PROMPTS}


def _generate(head: LocalHead, bundle: Path, prompt: list[int], speculative: bool) -> tuple[list[int], Stats]:
    stats = Stats()
    spec = make_speculation("prompt-lookup", "auto", read_manifest(bundle), config=EXACT_HINTS) if speculative \
        else None
    return list(head.generate(prompt, SamplingConfig(max_tokens=NEW_TOKENS), stats, spec)), stats


@pytest.mark.parametrize("stages", [1, 2])
def test_paged_stages_in_this_process_give_the_reference_tokens(bundles: dict[int, Path], reference: dict,
                                                                stages: int) -> None:
    """Every stage paged in one pool, one-token ticks on each stage's static copy; plain and with prompt lookup
    (drafts rejected and taken back by the block tables), every prompt's reference tokens."""
    with LocalHead(bundles[stages], config=EXACT_HINTS) as head:
        assert head.link.pooled and all(isinstance(s, PagedStage) for s in head.link.paged)
        assert head.engine.thread is None  # turned by the reader: no thread between a token and its reader
        for prompt in PROMPTS:
            before = [s.decode.steps for s in head.link.paged]  # type: ignore[union-attr]
            got, _ = _generate(head, bundles[stages], prompt, speculative=False)
            assert got == reference[tuple(prompt)], f"prompt {prompt}"
            assert all(s.decode.steps - b == NEW_TOKENS - 1  # type: ignore[union-attr]
                       for s, b in zip(head.link.paged, before, strict=True))
            got, stats = _generate(head, bundles[stages], prompt, speculative=True)
            assert got == reference[tuple(prompt)], f"prompt {prompt} with prompt lookup"
            if prompt == PROMPTS[0]:
                assert stats.rewinds > 0 and stats.drafted > stats.accepted > 0
        assert head.engine.blocks.used == 0  # every request's blocks went back (cached prefixes are evictable)


def test_stateful_stages_in_this_process_run_one_row_a_tick(bundles: dict[int, Path], reference: dict) -> None:
    """`--kv stateful`: the stages' own caches, one sequence at a time; rejected drafts are rewound on every stage
    and each new request clears them: the reference tokens, prompt after prompt."""
    with LocalHead(bundles[2], config=EXACT_HINTS, paged=False) as head:
        assert not head.link.pooled and all(isinstance(s, Stage) for s in head.link.stages)
        for prompt in PROMPTS:
            got, stats = _generate(head, bundles[2], prompt, speculative=True)
            assert got == reference[tuple(prompt)], f"prompt {prompt}"
            if prompt == PROMPTS[0]:
                assert stats.rewinds > 0


def test_a_stage_refused_in_paged_form_runs_stateful_beside_a_paged_one(bundles: dict[int, Path], reference: dict,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A stage whose paged form is refused runs stateful (the reason logged at INFO), the paged one beside it serving
    one sequence: speculation with rewinds still gives the reference tokens."""
    refuse_paged_stage(monkeypatch, 1)
    with caplog.at_level(logging.INFO, logger=inprocess.__name__), \
            LocalHead(bundles[2], config=EXACT_HINTS) as head:
        assert [type(s) for s in head.link.stages] == [OneSequence, Stage] and not head.link.pooled
        assert "stage 1: stateful KV cache" in caplog.text and "refused for the test" in caplog.text
        got, stats = _generate(head, bundles[2], PROMPTS[0], speculative=True)
    assert got == reference[tuple(PROMPTS[0])] and stats.rewinds > 0


def test_many_requests_at_once_on_a_thread_of_its_own(bundles: dict[int, Path], reference: dict) -> None:
    """With ``background`` the engine runs a Scheduler's requests together in one pool (the second and third prompts
    share a prefix): each request gets its reference tokens."""
    with LocalHead(bundles[1], config=EXACT_HINTS, slots=3, background=True) as head:
        assert head.engine.thread is not None
        session = Scheduler(head, streams=3)
        requests = [session.submit(list(prompt), SamplingConfig(max_tokens=NEW_TOKENS)) for prompt in PROMPTS]
        got = [request.result(timeout=120) for request in requests]
        session.close()
        assert head.planner_stats().seqs > head.planner_stats().ticks  # rows of several requests shared ticks
    assert got == [reference[tuple(prompt)] for prompt in PROMPTS]


def test_a_reader_that_stops_early_frees_the_blocks_and_the_next_request_runs(bundles: dict[int, Path],
                                                                               reference: dict) -> None:
    """Closing generate's iterator early cancels its request at once (its blocks back); the next one is exact."""
    with LocalHead(bundles[1], config=EXACT_HINTS) as head:
        tokens = head.generate(PROMPTS[0], SamplingConfig(max_tokens=NEW_TOKENS))
        assert [next(tokens) for _ in range(3)] == reference[tuple(PROMPTS[0])][:3]
        tokens.close()
        assert head.engine.blocks.used == 0
        assert _generate(head, bundles[1], PROMPTS[1], speculative=False)[0] == reference[tuple(PROMPTS[1])]


def test_in_process_stats_count_one_hop(bundles: dict[int, Path]) -> None:
    """In this process per_hop_network_ms is all a decode step costs beyond the stages' compute."""
    with LocalHead(bundles[2], config=EXACT_HINTS) as head:
        report = _generate(head, bundles[2], PROMPTS[1], speculative=False)[1].to_dict()
    beyond = report["mean_step_ms"] - report["stage0_compute_ms"] - report["stage1_compute_ms"]
    assert report["per_hop_network_ms"] == pytest.approx(beyond, abs=0.01)
