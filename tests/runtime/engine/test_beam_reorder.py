"""Batch > 1 and beam reordering in a compiled stage of the real stories260K model (fp32, exact hints).

Every KV state is gathered by ``beam_idx`` along the batch axis before a step (InjectBeamIdxGatherPass),
so a step with beam_idx [1, 0] must continue each row from the other row's history. Both stages are
checked: stage 0 fed token ids, stage 1 (the last) fed activations, since each holds its own caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32
from numpy.testing import assert_allclose

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.engine.stage import EXACT_HINTS

PROMPT_IDS = np.array([[1, 403, 407, 261, 378], [1, 365, 261, 466, 14]], dtype=np.int64)  # [2, T]
STEP_IDS = (np.array([[92], [388]], dtype=np.int64), np.array([[17], [261]], dtype=np.int64))  # [2, 1] each
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # same batch shape, same kernels: equal up to f32 rounding


@dataclass(frozen=True)
class StageRun:
    """One compiled stage and the inputs of a two-row request: a prompt, then two decode steps."""

    compiled: ov.CompiledModel
    primary: str  # input_ids (stage 0) or hidden_states (later stages)
    prompts: np.ndarray  # [2, T] ids or [2, T, H] activations, one different history per row
    steps: tuple[np.ndarray, ...]  # [2, 1] or [2, 1, H] each

    def run(self, prompts: np.ndarray, beams: list[list[int]]) -> list[np.ndarray]:
        """A fresh request: prefill ``prompts`` with beam_idx [0..B), then one step per entry of
        ``beams``, the cache gathered by it first; returns each step's output [B, 1, ...]."""
        request = self.compiled.create_infer_request()
        self._infer(request, prompts, 0, list(range(len(prompts))))
        past = prompts.shape[1]
        outputs = []
        for x, beam in zip(self.steps, beams, strict=False):
            outputs.append(self._infer(request, x, past, beam))
            past += x.shape[1]
        return outputs

    def _infer(self, request: ov.InferRequest, x: np.ndarray, past: int, beam: list[int]) -> np.ndarray:
        batch, seq = x.shape[:2]
        out = request.infer({
            self.primary: x,
            names.ATTENTION_MASK: np.ones((batch, past + seq), dtype=np.int64),  # [B, past + T]
            names.POSITION_IDS: np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),  # [B, T]
            names.BEAM_IDX: np.array(beam, dtype=np.int32),  # [B]
        })
        return out[self.compiled.output(0)].copy()


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("beam") / "b", stages=2)


@pytest.fixture(scope="module", params=[0, 1], ids=["stage0-ids", "stage1-activations"])
def stage(request: pytest.FixtureRequest, bundle: Path) -> StageRun:
    index = request.param
    entry = read_manifest(bundle).stages[index]
    compiled = ov.Core().compile_model(str(bundle / entry.model_xml), "CPU", EXACT_HINTS)
    if index == 0:
        return StageRun(compiled, names.INPUT_IDS, PROMPT_IDS, STEP_IDS)
    hidden = compiled.input(names.HIDDEN_STATES).get_partial_shape()[2].get_length()
    rng = np.random.default_rng(0)
    prompts = rng.standard_normal((2, PROMPT_IDS.shape[1], hidden)).astype(np.float32)  # [2, T, H]
    steps = tuple(rng.standard_normal((2, 1, hidden)).astype(np.float32) for _ in STEP_IDS)  # [2, 1, H]
    return StageRun(compiled, names.HIDDEN_STATES, prompts, steps)


def test_rows_of_a_batch_are_independent(stage: StageRun) -> None:
    """Two different prompts at batch 2 give each row what that prompt gives alone at batch 1."""
    together = stage.run(stage.prompts, [[0, 1]])[0]
    for row in range(2):
        alone = StageRun(stage.compiled, stage.primary, stage.prompts[row:row + 1],
                         tuple(x[row:row + 1] for x in stage.steps))
        assert_allclose(together[row:row + 1], alone.run(alone.prompts, [[0]])[0], rtol=1e-4, atol=1e-5)


def test_beam_idx_1_0_swaps_the_histories_of_the_rows(stage: StageRun) -> None:
    """A step with beam_idx [1, 0] equals a step with [0, 1] after a prefill that fed the prompts swapped."""
    swapped = stage.run(stage.prompts, [[1, 0]])[0]
    expected = stage.run(stage.prompts[::-1].copy(), [[0, 1]])[0]
    assert_allclose(swapped, expected, **TOLERANCE)
    unswapped = stage.run(stage.prompts, [[0, 1]])[0]
    assert not np.allclose(swapped, unswapped, atol=1e-3), "the two histories give the same output"


def test_beam_idx_0_0_continues_both_rows_from_row_0(stage: StageRun) -> None:
    """beam_idx [0, 0] forks row 0: both rows continue from row 0's history, row 1's is dropped."""
    forked = stage.run(stage.prompts, [[0, 0]])[0]
    expected = stage.run(np.stack([stage.prompts[0], stage.prompts[0]]), [[0, 1]])[0]
    assert_allclose(forked, expected, **TOLERANCE)


def test_a_reorder_stays_in_the_cache(stage: StageRun) -> None:
    """After a step with [1, 0], the next step with [0, 1] still continues the swapped histories."""
    reordered = stage.run(stage.prompts, [[1, 0], [0, 1]])[1]
    expected = stage.run(stage.prompts[::-1].copy(), [[0, 1], [0, 1]])[1]
    assert_allclose(reordered, expected, **TOLERANCE)
