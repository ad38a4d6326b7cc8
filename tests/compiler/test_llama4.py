"""Llama 4's numbers as ovshard reads them: the Scout preset, the nested ``llama4`` config, the refusals. That its
bundles match Hugging Face is tests/compiler/test_families.py's (rows ``llama4_text``, ``llama4_text_top2``)."""

from __future__ import annotations

import pytest

from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.description import describe
from ovshard.frontend.tensors import model_tensors
from ovshard.plan.costs import parameter_count
from ovshard.tools.shapes import family_config, preset


def test_scout_preset_counts_its_parameters_and_layers() -> None:
    """llama-4-scout: 107.8B parameters, every layer sparse (16 experts + a shared one), every 4th layer NoPE and
    global, the others chunked by 8192; its experts scale their inputs (nothing for the plugin to gather)."""
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
