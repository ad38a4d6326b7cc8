"""Multi-head latent attention (deepseek_v3): what its latent KV cache costs (and the expanded one it replaces),
where each count reads it, and what a compiled stage holds. Its logits against Hugging Face are the deepseek_v3
rows of test_families.py (latent form) and test_expanded_cache_gives_the_latent_cache_tokens here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from conftest import compile_fp32
from families import FAMILIES, moe_with_tokenizer, write_random_checkpoint

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.plan import format_bytes
from ovshard.bundle.weights import WeightFormat
from ovshard.cli import main
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import CheckpointError, UnsupportedArchitectureError
from ovshard.frontend.description import describe
from ovshard.plan.costs import model_costs, parameter_count
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.shapes import family_config, preset
from ovshard.verify.fusion import check_cpu_fusion
from ovshard.verify.inspect import summary


def test_deepseek_v3_preset_counts_its_parameters_and_its_latent_cache() -> None:
    """The deepseek-v3 shape holds 671B parameters; a cached token costs each layer one head of keys (latent 512 +
    rotary key 64) and values (the latent, 512), at u8 576 x 1.25 + 512 + 8 bytes (keys with a block's scale and
    zero point a channel, values with a token's), dense and sparse layers alike; held expanded it would cost
    128 heads x (192 x 1.25 + 128 + 8)."""
    model = describe(preset("deepseek-v3"))
    d = model.dims
    assert parameter_count(model.arch, d) == 671_026_419_200
    assert d.latent_cache and d.cache_dims == (576, 512) and d.cache_heads == 1 and d.dense_layers == (0, 1, 2)
    assert model.block.rotary_dim == 64 and model.block.rope_interleave
    layers = [b for b in model_costs(model.arch, d, WeightFormat("int4_asym", 128)).blocks if b.kind == "layer"]
    assert {b.kv_bytes_per_token for b in layers} == {576 * 5 // 4 + 512 + 8} == {1_240}
    expanded = replace(d, latent_cache=False)
    assert expanded.cache_dims == (192, 128) and expanded.cache_heads == 128
    assert expanded.kv_elements_per_token * 2 == 81_920


def test_yarn_mscale_scales_the_softmax() -> None:
    """With yarn and mscale_all_dim, the scores' scale is head_dim^-0.5 times (0.1 ln(factor) + 1)^2 (transformers'
    yarn_apply_mscale); without a scaled rope it is head_dim^-0.5."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    config = preset("deepseek-v3")
    expected = yarn_apply_mscale(config["rope_parameters"], 192 ** -0.5)
    assert describe(config).block.attention_scale == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(192 ** -0.5 * (0.1 * 3.6888794541139363 + 1) ** 2)
    assert describe(family_config("deepseek_v3")).block.attention_scale == pytest.approx(24 ** -0.5)


def test_fewer_key_value_heads_than_heads_is_refused() -> None:
    """kv_b_proj expands a key and a value for every head: a config claiming fewer KV heads is refused by name."""
    with pytest.raises(CheckpointError, match="num_key_value_heads=2 for 4 attention heads"):
        describe(family_config("deepseek_v3", num_key_value_heads=2))


def test_stages_cache_keys_and_values_of_their_own_widths(tmp_path: Path) -> None:
    """A 2-stage bundle's KV states are one head of keys [batch, 1, ?, latent 16 + rotary key 8] and values
    [batch, 1, ?, 16], and `ovshard inspect` shows each stage's planned KV bytes per token at u8 (layers x (24 x
    1.25 + 16 + 8)) and a layer's per token, beside what the expanded cache (4 heads x (24 x 1.25 + 12 + 8)) would
    hold."""
    checkpoint = write_random_checkpoint(FAMILIES["deepseek_v3"], tmp_path / "ckpt")
    bundle = compile_fp32(checkpoint, tmp_path / "b", stages=2)
    manifest = read_manifest(bundle)
    assert manifest.architecture.cache_dims == (24, 16) and manifest.architecture.cache_heads == 1
    for entry in manifest.stages:
        model = ov.Core().read_model(bundle / entry.model_xml)
        shapes = {op.get_friendly_name(): (op.get_output_partial_shape(0)[1].get_length(),
                                           op.get_output_partial_shape(0)[3].get_length())
                  for op in model.get_ops() if op.get_type_name() == "ReadValue"}
        layers = range(*entry.layers)
        expected = {names.past_key(i): (1, 24) for i in layers} | {names.past_value(i): (1, 16) for i in layers}
        assert shapes == expected
        planned = manifest.plan.stages[entry.index]
        assert planned.kv_bytes_per_token == len(layers) * (30 + 24)  # u8: keys 24 x 1.25, values 16 + 8
    shown = summary(bundle, manifest)
    assert all(format_bytes(s.kv_bytes_per_token) in shown for s in manifest.plan.stages), shown
    assert ("KV cache: 54 B a token a layer (1 head x (keys 24 + values 16) as u8 (keys by channel, values by token, each with an f32 scale and zero point; from the bundle's CPU hints); f16 would be 80 B); latent "
            "attention's latent cache (keys: latent 16 + rotary key 8, values: the latent), held expanded it would "
            "be 200 B") in shown, shown


def test_expanded_cache_gives_the_latent_cache_tokens(tmp_path: Path) -> None:
    """fp32, 2 stages: the expanded form (`ovshard compile --mla-cache expanded`: 4 heads of keys 24 and values 12
    cached) and the latent form give the same greedy tokens, logits within 1e-4, and inspect names the form each
    holds."""
    checkpoint = write_random_checkpoint(FAMILIES["deepseek_v3"], tmp_path / "ckpt")
    compile_fp32(checkpoint, tmp_path / "latent", stages=2)
    assert main(["-q", "compile", str(checkpoint), "-o", str(tmp_path / "expanded"), "--stages", "2", "--weights",
                 "fp32", "--no-cache", "--mla-cache", "expanded"]) == 0
    found = {}
    for form in ("latent", "expanded"):
        bundle = tmp_path / form
        assert read_manifest(bundle).architecture.latent_cache == (form == "latent")
        ids, rows = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy([2, 17, 42, 99], 12)
        found[form] = ids, np.stack(rows)
    assert found["latent"][0] == found["expanded"][0]
    assert float(np.abs(found["latent"][1] - found["expanded"][1]).max()) <= 1e-4
    shown = summary(tmp_path / "expanded", read_manifest(tmp_path / "expanded"))
    assert ("200 B a token a layer (4 heads x (keys 24 + values 12) as u8") in shown, shown
    assert "latent attention held expanded: its latent cache" in shown and "would be 54 B" in shown, shown


def test_whole_stage_trace_equals_the_streamed_compile(tmp_path: Path) -> None:
    """fp32, 2 stages: tracing each stage whole (streaming off) gives the streamed compile's greedy tokens and
    logits (max |diff| <= 1e-5)."""
    checkpoint = write_random_checkpoint(FAMILIES["deepseek_v3"], tmp_path / "ckpt")
    found = {}
    for streaming in (True, False):
        out = tmp_path / f"b{int(streaming)}"
        compile_bundle(CompileConfig(checkpoint, out, stages=2, weights=WeightFormat("fp32"), streaming=streaming))
        ids, rows = LocalPipeline(out, config=EXACT_HINTS).generate_greedy([2, 17, 42, 99], 12)
        found[streaming] = ids, np.stack(rows)
    assert found[True][0] == found[False][0]
    assert float(np.abs(found[True][1] - found[False][1]).max()) <= 1e-5


def test_latent_projections_the_int8_choice_names_stay_int8(tmp_path: Path) -> None:
    """An INT4 compile whose INT8 share names a layer's q_a, q_b, kv_a and kv_b (as the budget's choice does at
    DeepSeek-V3's width) keeps those four INT8 (q_a and kv_a fused: they read one input; kv_b's two absorbed
    halves, W_UK and W_UV by head, both) and o INT4."""
    checkpoint = write_random_checkpoint(FAMILIES["deepseek_v3"], tmp_path / "ckpt")
    fmt = WeightFormat("int4_sym", group_size=8, budget=1.15, int8_weights=("1.q_a", "1.q_b", "1.kv_a", "1.kv_b"))
    manifest = compile_bundle(CompileConfig(checkpoint, tmp_path / "b", stages=1, weights=fmt))
    constants = [op for op in ov.Core().read_model(tmp_path / "b" / manifest.stages[0].model_xml).get_ordered_ops()
                 if op.get_type_name() == "Constant" and "layers.1." in op.get_friendly_name()]
    types = {op.get_friendly_name().split("layers.")[-1]: op.get_output_element_type(0).get_type_name()
             for op in constants}
    halves = {op.get_friendly_name().split(":")[0]: op.get_output_element_type(0).get_type_name() for op in constants
              if op.get_friendly_name().endswith("layers.1.kv_b_weight")}
    assert halves == {"key": "u8", "value": "u8"}, halves
    assert {types["1.kv_a_weight+q_a_weight"], types["1.q_b_weight"]} == {"u8"}, types
    assert types["1.o_weight"] == "i4", types


def test_calibrated_int4_default_fuses_attention_and_gathers_the_sparse_layers(stories: Path, tmp_path: Path) -> None:
    """The default compile (INT4, calibrated on the shipped text through stories260K's tokenizer) of an MLA model:
    every stage fuses its KV cache into one SDPA a layer, and each sparse layer's experts become 3 GatherMatmuls."""
    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt", "deepseek_v3")
    manifest = compile_bundle(CompileConfig(checkpoint, tmp_path / "b", stages=2))
    assert manifest.weights.mode.startswith("int4") and manifest.weights.calibration == "text"
    reports = check_cpu_fusion(tmp_path / "b", manifest)
    found = [(r.stage, r.layers, r.moe_layers, r.gather_matmuls, r.fused_sdpa) for r in reports]
    assert all(r.ok and r.fused_sdpa == r.layers and r.gather_matmuls == 3 * r.moe_layers for r in reports), found
    assert sum(r.moe_layers for r in reports) == 3, found


@pytest.mark.parametrize(("key", "value"), [("scoring_func", "softmax"), ("moe_layer_freq", 2),
                                            ("topk_method", "group_limited_greedy")])
def test_deepseek_keys_transformers_ignores_are_refused_off_their_v3_values(key: str, value: object) -> None:
    """config.json keys of DeepSeek's own code that transformers drops are accepted at V3's values and refused at
    any other (they would change which experts run), naming the key."""
    describe(family_config("deepseek_v3", scoring_func="sigmoid", moe_layer_freq=1, topk_method="noaux_tc"))
    with pytest.raises(UnsupportedArchitectureError, match=f"{key}="):
        describe(family_config("deepseek_v3", **{key: value}))
