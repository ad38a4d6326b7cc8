"""Llama 4's numbers as ovshard reads them: the Scout preset, the nested ``llama4`` config, the refusals. That its
bundles match Hugging Face is tests/compiler/test_families.py's (rows ``llama4_text``, ``llama4_text_top2``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from families import FAMILIES, moe_with_tokenizer, write_random_checkpoint

from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.description import describe
from ovshard.frontend.tensors import model_tensors
from ovshard.plan.costs import parameter_count
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.shapes import family_config, preset
from ovshard.verify.fusion import check_cpu_fusion


def test_scout_preset_counts_its_parameters_and_layers() -> None:
    """llama-4-scout: 107.8B parameters, every layer sparse (16 experts + a shared one), every 4th layer NoPE and
    global, the others chunked by 8192; its one expert a token scales its input (gathered all the same)."""
    model = describe(preset("llama-4-scout"))
    d, blk = model.dims, model.block
    assert parameter_count(model.arch, d) == 107_769_861_120
    assert d.dense_layers == () and d.num_experts == 16 and d.experts_per_token == 1
    assert d.expert_size == d.shared_expert_size == 8192 and d.intermediate_size == 16384
    assert blk.nope_layers == tuple(range(3, 48, 4)) and blk.attention_chunk == d.attention_chunk == 8192
    assert {blk.mask_kind(i) for i in blk.nope_layers} == {"full_attention"}
    assert blk.mask_kind(0) == "chunked_attention" and blk.qk_l2_norm and blk.rope_interleave
    assert blk.temperature == (8192.0, 0.1) and d.expert_input_scores


def test_a_nested_llama4_config_reads_its_text_config_under_the_language_model() -> None:
    """A Llama4ForConditionalGeneration config.json: the language model's numbers from text_config, its tensors under
    language_model., the vision tower and projector never read."""
    text = family_config("llama4_text")
    model = describe({"model_type": "llama4", "text_config": text, "vision_config": {"model_type": "llama4_vision_model"},
                      "tie_word_embeddings": False})
    assert model.arch.family == "llama4" and model.dims.dense_layers == (0, 2) and model.block.nope_layers == (1, 3)
    names = model_tensors(model.arch, model.dims)
    assert "language_model.model.layers.1.feed_forward.experts.gate_up_proj" in names
    assert "language_model.model.layers.0.feed_forward.gate_proj.weight" in names
    assert "language_model.lm_head.weight" in names
    assert model.unread_prefixes[:2] == ("vision_model.", "multi_modal_projector.")


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, "attention_chunk_size"),
])
def test_malformed_llama4_layer_settings_are_refused(overrides: dict, needle: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=needle):
        describe(family_config("llama4_text", **overrides))


@pytest.mark.slow
def test_whole_stage_trace_equals_the_streamed_compile(tmp_path: Path) -> None:
    """fp32, 3 stages: tracing each stage whole gives the streamed compile's greedy tokens and logits (the NoPE
    layers' query scale crosses the pieces as a port of its own)."""
    checkpoint = write_random_checkpoint(FAMILIES["llama4_text"], tmp_path / "ckpt")
    found = {}
    for streaming in (True, False):
        out = tmp_path / f"b{int(streaming)}"
        compile_bundle(CompileConfig(checkpoint, out, stages=3, weights=WeightFormat("fp32"), streaming=streaming))
        ids, rows = LocalPipeline(out, config=EXACT_HINTS).generate_greedy([2, 17, 42, 99, 5, 6, 7, 8, 9], 12)
        found[streaming] = ids, np.stack(rows)
    assert found[True][0] == found[False][0]
    assert float(np.abs(found[True][1] - found[False][1]).max()) <= 1e-5


@pytest.mark.slow
def test_calibrated_int4_default_fuses_attention_and_gathers_the_routed_expert(stories: Path, tmp_path: Path) -> None:
    """The default compile (INT4, calibrated on the shipped text) of a Llama 4 model (top-1, layers 1 and 3 sparse):
    every stage fuses its KV cache into one SDPA a layer (chunked and NoPE layers alike) and runs its sparse layer's
    gate, up and down as GatherMatmul ops, which read only the routed expert's INT4 weights."""
    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt", "llama4_text")
    manifest = compile_bundle(CompileConfig(checkpoint, tmp_path / "b", stages=2))
    assert manifest.weights.mode.startswith("int4") and manifest.weights.calibration == "text"
    reports = check_cpu_fusion(tmp_path / "b", manifest)
    found = [(r.stage, r.layers, r.moe_layers, r.gather_matmuls, r.fused_sdpa) for r in reports]
    assert all(r.ok and r.fused_sdpa == r.layers and r.moe_layers == 1 and r.gather_matmuls == 3
               for r in reports), found
    assert not any(r.runtime_ops.get("MatMul", 0) for r in reports), found  # no expert left as a dense MatMul
