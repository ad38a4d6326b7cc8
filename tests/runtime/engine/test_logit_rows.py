"""Logits only where needed: the last stage, as a worker loads it, computes the rows a step reads.

The worker slices the lm_head's input to the last ``logit_rows`` rows (runtime/engine/logit_rows.py): a prefill of
T tokens that decodes the next one computes [1, 1, vocab], not [1, T, vocab], and those rows equal the
whole tensor's last rows. The bundle on disk keeps its ordinary all-rows graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32
from families import FAMILIES, write_random_checkpoint

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.engine.kv import step_inputs
from ovshard.runtime.engine.logit_rows import slice_logit_rows
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.wire.protocol import rows_read

PROMPT = [1, 403, 407, 261, 378, 290, 18, 7]


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rows")
    gemma2 = write_random_checkpoint(FAMILIES["gemma2"], root / "gemma2-ckpt")  # final logit soft-capping
    return {"stories260K": compile_fp32(stories, root / "stories", stages=1),  # tied: the head is the embedding
            "gemma2": compile_fp32(gemma2, root / "gemma2", stages=1)}


def _run(compiled: ov.CompiledModel, ids: list[int], rows: int | None) -> np.ndarray:
    request = compiled.create_infer_request()
    inputs = step_inputs(names.INPUT_IDS, np.array([ids], np.int64), [1] * len(ids), 0, 1 << 16)
    if rows is not None:
        inputs[names.LOGIT_ROWS] = np.array([rows], np.int64)
    request.infer(inputs)
    return request.get_tensor(names.LOGITS).data.copy()


def _last_stage(bundle: Path) -> tuple[ov.Model, int]:
    manifest = read_manifest(bundle)
    return ov.Core().read_model(bundle / manifest.stages[-1].model_xml), manifest.architecture.vocab_size


@pytest.mark.parametrize("name", ["stories260K", "gemma2"])
def test_the_sliced_stage_computes_the_last_rows_and_they_equal_the_whole(bundles: dict[str, Path],
                                                                          name: str) -> None:
    model, vocab = _last_stage(bundles[name])
    core = ov.Core()
    whole = _run(core.compile_model(model.clone(), "CPU", EXACT_HINTS), PROMPT, None)
    sliced = core.compile_model(slice_logit_rows(model, vocab), "CPU", EXACT_HINTS)
    for rows in (1, 3, len(PROMPT)):
        found = _run(sliced, PROMPT, rows)
        assert found.shape == (1, rows, vocab)
        assert np.abs(found - whole[:, -rows:]).max() < 1e-5


def test_the_runtime_graph_slices_before_the_lm_head(bundles: dict[str, Path]) -> None:
    """In the CPU plugin's compiled graph the lm_head (the FullyConnected with vocabulary-wide output)
    reads a slice of the hidden states, and the logits output is [1, 1, vocab] after an 8-token prefill."""
    bundle = bundles["stories260K"]
    manifest = read_manifest(bundle)
    from ovshard.runtime.node.worker import StageWorker

    worker = StageWorker(bundle, manifest.num_stages - 1, config=EXACT_HINTS, kv="stateful")
    try:
        runtime = worker.backend.compiled.get_runtime_model()
        kinds = {op.get_friendly_name(): op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ops()}
        heads = [op for op in runtime.get_ops() if kinds[op.get_friendly_name()] == "FullyConnected"
                 and op.get_output_partial_shape(0)[-1].is_static
                 and op.get_output_partial_shape(0)[-1].get_length() == manifest.architecture.vocab_size]
        assert len(heads) == 1, sorted(set(kinds.values()))
        source = heads[0].input_value(0).get_node()
        assert kinds[source.get_friendly_name()] in ("StridedSlice", "Slice"), kinds[source.get_friendly_name()]
        request = worker.backend.compiled.create_infer_request()
        inputs = step_inputs(names.INPUT_IDS, np.array([PROMPT], np.int64), [1] * len(PROMPT), 0, 1 << 16)
        request.infer({**inputs, names.LOGIT_ROWS: np.array([rows_read("argmax@1", len(PROMPT))], np.int64)})
        assert request.get_tensor(names.LOGITS).shape == [1, 1, manifest.architecture.vocab_size]
    finally:
        worker.stop()


def test_rows_for_reads_the_step_want() -> None:
    assert [rows_read(w, 8) for w in ("argmax", "argmax@1", "argmax@3", "logits", "topk:5", "logits@20")] == [
        8, 1, 3, 1, 1, 8]
