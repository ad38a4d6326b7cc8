"""The ONNX front end gives the stages the TorchScript front end gives: same I/O, same numbers, same CPU fusion."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.stage import StageSpec
from ovshard.frontend import trace
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.synth import llama_config, write_checkpoint
from ovshard.verify.fusion import runtime_fusion

pytestmark = pytest.mark.slow


PROMPTS = {"stories260K": [1, 403, 407, 261, 378], "random": [1, 17, 42, 99, 5, 200]}  # random: vocab 256
NEW_TOKENS = 8  # the prefill picks the first; 7 decode steps follow
MAX_LOGIT_DIFF = 1e-4


def _checkpoint(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if source == "stories260K":
        return request.getfixturevalue("stories")
    return write_checkpoint(tmp_path / "ckpt", llama_config(), seed=3)


@pytest.mark.parametrize("source", sorted(PROMPTS))
def test_onnx_stages_match_torchscript_stages(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A 2-stage bundle from ONNX-exported stages has the same I/O, logits (<= 1e-4) and greedy tokens, fully fused."""
    checkpoint = _checkpoint(source, request, tmp_path)
    reference = compile_fp32(checkpoint, tmp_path / "torchscript", stages=2)
    onnx = compile_fp32(checkpoint, tmp_path / "onnx", stages=2, frontend="onnx")
    assert read_manifest(onnx).source.frontend == "onnx"
    for want, got in zip(read_manifest(reference).stages, read_manifest(onnx).stages, strict=True):
        assert (got.inputs, got.outputs, got.state_variables) == (want.inputs, want.outputs, want.state_variables)

    want_tokens, want_rows = LocalPipeline(reference, config=EXACT_HINTS).generate_greedy(PROMPTS[source], NEW_TOKENS)
    pipeline = LocalPipeline(onnx, config=EXACT_HINTS)
    tokens, rows = pipeline.generate_greedy(PROMPTS[source], NEW_TOKENS)
    diff = float(np.abs(np.stack(rows) - np.stack(want_rows)).max())
    assert tokens == want_tokens
    assert diff <= MAX_LOGIT_DIFF, f"max |logit diff| {diff:.2e} > {MAX_LOGIT_DIFF:.0e}"

    for i, stage in enumerate(pipeline.stages):
        start, end = stage.entry.layers
        report = runtime_fusion(stage.compiled, i, end - start)
        assert report.ok, f"stage {i}: KV cache not fused into attention: {report}"
    print(f"{source}: {NEW_TOKENS}/{NEW_TOKENS} greedy tokens equal, max |logit diff| {diff:.2e}, all SDPA fused")


def test_onnx_frontend_frees_torch_weights_before_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor the stage loaded is garbage before OpenVINO reads the ONNX file: weights are never held twice."""
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "ckpt", llama_config()))
    refs: list[weakref.ref] = []
    alive_at_conversion: list[int] = []
    load, convert = ckpt.load, trace.ov.convert_model

    def recording_load(name: str):
        tensor = load(name)
        refs.append(weakref.ref(tensor))
        return tensor

    def checking_convert(*args, **kwargs):
        alive_at_conversion.append(sum(r() is not None for r in refs))
        return convert(*args, **kwargs)

    monkeypatch.setattr(ckpt, "load", recording_load)
    monkeypatch.setattr(trace.ov, "convert_model", checking_convert)
    model = trace.trace_stage(ckpt, StageSpec(1, 2, 1, 2), frontend="onnx")
    del model
    gc.collect()
    assert refs and alive_at_conversion == [0], f"{alive_at_conversion} of {len(refs)} tensors alive at conversion"
    assert not [r for r in refs if r() is not None]


def test_unknown_frontend_is_refused(tmp_path: Path) -> None:
    """A front end outside FRONTENDS raises before anything is loaded, naming the valid ones."""
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "ckpt", llama_config()))
    with pytest.raises(ValueError, match="torchscript.*onnx"):
        trace.trace_stage(ckpt, StageSpec(0, 1, 0, 2), frontend="tflite")
