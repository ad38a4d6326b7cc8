"""Mixtures of experts beyond exactness (tests/compiler/test_families.py proves the fp32 rows against HF): the
default INT4 compile keeps the router f32 and each expert INT4 while the CPU plugin still reads only the routed
experts, its INT8 share bounded by what a token reads as well as by memory; the planner counts a layer's memory
by all its experts and its step by the routed ones; dense layers
among sparse ones are the layers transformers builds dense, and every count follows them; a cut of the
Qwen3-30B-A3B preset (its 128 experts, top 8) compiles from ``ovshard synth``; and speculative decoding over
stage worker processes runs an MoE bundle unchanged."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from conftest import compile_fp32, generate_concurrently
from families import FAMILIES, write_random_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.plan import format_bytes
from ovshard.bundle.weights import WeightFormat
from ovshard.cli import main
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import CheckpointError
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.frontend.description import describe
from ovshard.frontend.tensors import linear_shapes
from ovshard.plan.costs import bytes_per_weight, model_costs
from ovshard.plan.precision import (
    BASE,
    all_int4_bytes,
    candidates,
    choose_int8,
    int4_error,
    stacked_int4_error,
)
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import make_speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.tools.shapes import family_config, preset
from ovshard.tools.synth import with_layers
from ovshard.verify.checks import runtime_rows
from ovshard.verify.fusion import check_cpu_fusion
from ovshard.verify.inspect import summary


def _weight_types(xml: Path) -> dict[str, tuple[str, list[int]]]:
    """Each decoder weight constant of a stage IR by its name's tail (``0.router_weight`` ...): type and shape."""
    found = {}
    for op in ov.Core().read_model(str(xml)).get_ordered_ops():
        name = op.get_friendly_name()
        if op.get_type_name() == "Constant" and name.endswith("_weight") and "layers." in name:
            tail = name.split("layers.")[-1]
            found[tail] = (op.get_output_element_type(0).get_type_name(), list(op.get_output_shape(0)))
    return found


def test_int4_compile_keeps_the_router_f32_and_gathers_int4_experts(tmp_path: Path) -> None:
    """Default INT4 (2 stages): every expert INT4 per group, the router f32, GatherMatmul on every stage, and
    `ovshard verify`'s runtime rows all pass (the f32 router counted as such, not as an uncompressed weight)."""
    checkpoint = write_random_checkpoint(FAMILIES["qwen3_moe"], tmp_path / "ckpt")
    manifest = compile_bundle(CompileConfig(checkpoint, tmp_path / "b", stages=2))
    assert manifest.weights.mode.startswith("int4")
    reports = check_cpu_fusion(tmp_path / "b", manifest)
    found = [(r.stage, r.moe_layers, r.gather_matmuls, r.fused_sdpa) for r in reports]
    assert all(r.ok and r.gather_matmuls == 3 * r.layers for r in reports), found  # gate, up, down a layer
    rows = runtime_rows(tmp_path / "b", manifest, "CPU", ov.Core())  # what `ovshard verify` prints
    assert [r.verdict for r in rows] == ["pass"] * len(rows), rows
    assert {r.check for r in rows} >= {"experts as GatherMatmul (reading only the routed experts)", "weight storage"}
    weights = _weight_types(tmp_path / "b" / manifest.stages[0].model_xml)
    assert weights["0.router_weight"] == ("f32", [8, 64])
    int8_kept = set(manifest.weights.int8_weights)
    for key in ("experts_gate", "experts_up", "experts_down"):
        kind, shape = weights[f"0.{key}_weight"]
        if f"0.{key}" not in int8_kept:
            assert kind in ("i4", "u4") and shape[0] == 8 and len(shape) == 4, (key, kind, shape)  # [E, out, groups, g]


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3"])
def test_the_int8_share_stays_within_the_budget_of_what_a_token_reads(family: str, tmp_path: Path) -> None:
    """The default's INT8 choice keeps within 1.15x of the all-INT4 bytes both held and read a step, a sparse
    layer's experts read at top-k of all (GLM-4.5's block: 2 of 8). For the mixture the read bound is what binds:
    spending by memory alone keeps INT8 projections that a token reads whole beyond it. For a dense model the two
    bounds are one sum, so its choice is the memory one (its bundles unchanged)."""
    ckpt = open_checkpoint(write_random_checkpoint(FAMILIES[family], tmp_path / "ckpt"))
    dims, fmt, unit = ckpt.dims, WeightFormat(), replace(BASE, all_layers=False)
    scored = {c.key: c for c in candidates(ckpt, fmt)}
    held_room = 1.15 * all_int4_bytes(dims, unit) - all_int4_bytes(dims, fmt)
    read_room = 1.15 * all_int4_bytes(dims, unit, routed=True) - all_int4_bytes(dims, fmt, routed=True)
    chosen = choose_int8(ckpt, fmt)
    assert chosen and sum(scored[k].extra_bytes for k in chosen) <= held_room
    assert sum(scored[k].extra_bytes * scored[k].read_share for k in chosen) <= read_room
    by_memory, spent = [], 0.0  # the choice were memory the only bound
    for c in sorted(scored.values(), key=lambda c: c.error, reverse=True):
        if spent + c.extra_bytes <= held_room:
            by_memory.append(c.key)
            spent += c.extra_bytes
    read_by_memory = sum(scored[k].extra_bytes * scored[k].read_share for k in by_memory)
    if family == "qwen3":
        assert read_room == held_room and {c.read_share for c in scored.values()} == {1.0}
        assert chosen == tuple(sorted(by_memory, key=lambda k: (int(k.split(".")[0]), k.split(".")[1])))
    else:
        shares = {k: c.read_share for k, c in scored.items() if ".experts_" in k}
        assert shares and set(shares.values()) == {2 / 8} and dims.experts_per_token == 2
        assert read_by_memory > read_room, (read_by_memory, read_room)


def test_stacked_experts_are_scored_as_one_matrix_an_expert_at_a_time() -> None:
    """A layer's stacked experts get the INT4 error of their matrices taken as one (so the choice is unchanged),
    computed one expert at a time (so the quantizer's temporaries are one expert's)."""
    weights = np.random.default_rng(0).standard_normal((8 * 64, 256)).astype(np.float32)
    for fmt in (WeightFormat(), WeightFormat("int4_asym", 64)):
        assert stacked_int4_error(weights.reshape(8, 64, 256), fmt) == pytest.approx(int4_error(weights, fmt),
                                                                                    rel=1e-5)


DENSE_LAYOUTS = {  # config keys that make some layers of a 6-layer MoE model dense
    "mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [1, 3]}),
    "decoder_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 3}),
    "both": ("qwen3_moe", {"mlp_only_layers": [5], "decoder_sparse_step": 2}),
    "first_k_dense_replace": ("glm4_moe", {"first_k_dense_replace": 2}),
}


@pytest.mark.parametrize("layout", sorted(DENSE_LAYOUTS))
def test_dense_layers_are_the_ones_transformers_builds_dense(layout: str) -> None:
    """The layers ovshard reads as dense are those whose transformers module has no experts, for each rule."""
    model_type, overrides = DENSE_LAYOUTS[layout]
    config = family_config(model_type, num_hidden_layers=6, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    dense = tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))
    assert dense and len(dense) < 6
    assert describe(config).dims.dense_layers == dense


def test_glm_config_keys_left_out_take_transformers_defaults() -> None:
    """A GLM-4.5 config.json without norm_topk_prob renormalizes (Glm4MoeConfig's default), as transformers does."""
    config = family_config("glm4_moe", norm_topk_prob=False)
    assert not describe(config).block.norm_topk
    del config["norm_topk_prob"]
    assert describe(config).block.norm_topk and AutoConfig.for_model(**config).norm_topk_prob


def test_a_dense_layer_counts_its_mlp_and_a_sparse_one_its_experts() -> None:
    """GLM-4.5-Air: layer 0 holds and reads a dense MLP of 10944; the others hold 128 experts + 1 shared and read 8
    + 1; the INT4 plan's unit (all-INT4 bytes) sums the same per-layer projections."""
    model = describe(preset("glm-4.5-air"))
    d, fmt = model.dims, WeightFormat("int4_asym", 128, ratio=1.0, budget=1.0)
    assert d.dense_layers == (0,) and d.shared_expert_size == 1408 and d.sparse(1) and not d.sparse(0)
    layers = [b for b in model_costs(model.arch, d, fmt).blocks if b.kind == "layer"]
    per_weight = bytes_per_weight(fmt)
    attention = d.hidden_size * d.head_dim * (2 * d.num_heads + 2 * d.num_kv_heads)
    dense, expert = 3 * d.hidden_size * d.intermediate_size, 3 * d.hidden_size * d.expert_size
    router = d.num_experts * d.hidden_size
    assert layers[0].weight_bytes == pytest.approx((attention + dense) * per_weight, rel=0.02)
    assert layers[0].read_bytes is None  # all of it
    assert layers[1].weight_bytes == pytest.approx((attention + router + 129 * expert) * per_weight, rel=0.02)
    assert layers[1].read_bytes == pytest.approx((attention + router + 9 * expert) * per_weight, rel=0.02)
    assert {key for key in linear_shapes(d, 0)} == {"q", "k", "v", "o", "gate", "up", "down"}
    assert {"experts_gate", "shared_down"} <= set(linear_shapes(d, 45))


def test_int4_glm4_moe_gathers_only_its_sparse_layers_and_plans_int8_per_layer_kind(tmp_path: Path) -> None:
    """Default INT4 of a GLM-4.5-block model (layer 0 dense) in 2 stages: GatherMatmuls for the sparse layers only,
    every stage's KV fused, the router f32; the INT8 choice scores each layer's own projections."""
    checkpoint = write_random_checkpoint(FAMILIES["glm4_moe"], tmp_path / "ckpt")
    manifest = compile_bundle(CompileConfig(checkpoint, tmp_path / "b", stages=2))
    dims = manifest.architecture
    assert dims.dense_layers == (0,)
    reports = check_cpu_fusion(tmp_path / "b", manifest)
    found = [(r.stage, r.layers, r.moe_layers, r.gather_matmuls, r.fused_sdpa) for r in reports]
    assert all(r.ok for r in reports) and sum(r.moe_layers for r in reports) == 2, found
    assert [r.gather_matmuls for r in reports] == [3 * r.moe_layers for r in reports], found
    weights = _weight_types(tmp_path / "b" / manifest.stages[0].model_xml)
    assert not any(k.startswith("0.experts") for k in weights) and "0.down_weight" in weights
    assert weights["1.router_weight"] == ("f32", [8, 64])
    valid = {f"{i}.{key}" for i in range(dims.num_layers) for key in linear_shapes(dims, i)}
    assert set(manifest.weights.int8_weights) <= valid
    scored = {c.key for c in candidates(open_checkpoint(checkpoint), manifest.weights)}
    assert {"0.down", "1.experts_gate", "2.shared_up"} <= scored and "0.experts_gate" not in scored
    shown = summary(tmp_path / "b", manifest)  # `ovshard inspect`: the plan's bytes, from the per-layer cost model
    assert all(format_bytes(planned.weight_bytes) in shown for planned in manifest.plan.stages), shown


def test_multi_token_prediction_layers_stored_after_the_last_are_left_unread(tmp_path: Path) -> None:
    """A GLM-4.5 checkpoint holds its multi-token-prediction layer after the last, as released
    (num_nextn_predict_layers 1): the check passes it by; a tensor of any layer past that is still refused."""
    from safetensors.torch import load_file, save_file

    checkpoint = write_random_checkpoint(FAMILIES["glm4_moe"], tmp_path / "ckpt")
    file = checkpoint / "model.safetensors"
    state = load_file(file)
    save_file({**state, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, file, metadata={"format": "pt"})
    open_checkpoint(checkpoint).validate_tensors()
    save_file({**state, "model.layers.4.eh_proj.weight": torch.zeros(64, 128)}, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.4.eh_proj.weight"):
        open_checkpoint(checkpoint).validate_tensors()


def test_placement_counts_all_experts_in_memory_and_the_routed_ones_in_a_step() -> None:
    """Qwen3-30B-A3B: a layer's memory holds 128 experts, a decode step reads 8 (its published 3.3B active)."""
    model = describe(preset("qwen3-30b-a3b"))
    d, fmt = model.dims, WeightFormat("int4_asym", 128, ratio=1.0, budget=1.0)  # all INT4: no INT8 budget spread
    layers = [b for b in model_costs(model.arch, d, fmt).blocks if b.kind == "layer"]
    attention = d.hidden_size * d.head_dim * (2 * d.num_heads + 2 * d.num_kv_heads)
    expert = 3 * d.hidden_size * d.expert_size
    router = d.num_experts * d.hidden_size
    per_weight = bytes_per_weight(fmt)
    held = sum(b.weight_bytes for b in layers)
    read = sum(b.read_bytes or 0 for b in layers)
    assert held == pytest.approx(d.num_layers * (attention + router + 128 * expert) * per_weight, rel=0.05)
    assert read == pytest.approx(d.num_layers * (attention + router + 8 * expert) * per_weight, rel=0.05)
    assert 10 < held / read < 20  # ~30B held against ~2.7B of decoder weights read


@pytest.mark.slow
def test_a_one_layer_cut_of_qwen3_30b_a3b_compiles_with_its_experts_gathered(tmp_path: Path) -> None:
    """`ovshard synth` of the qwen3-30b-a3b preset cut to 1 layer (its 128 experts and top 8; narrowed to
    hidden 256, experts of 64, vocabulary 1024 for a test machine) compiles to INT4 with 3 GatherMatmuls."""
    config = with_layers(preset("qwen3-30b-a3b"), 1)
    config.update(hidden_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=1024, bos_token_id=1, eos_token_id=2, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["synth", str(tmp_path / "config.json"), "-o", str(tmp_path / "ckpt")]) == 0
    assert describe(config).dims.num_experts == 128 and describe(config).dims.experts_per_token == 8
    manifest = compile_bundle(CompileConfig(tmp_path / "ckpt", tmp_path / "b", stages=1))
    (report,) = check_cpu_fusion(tmp_path / "b", read_manifest(tmp_path / "b"))
    assert report.ok and report.gather_matmuls == 3, report.runtime_ops
    weights = _weight_types(tmp_path / "b" / manifest.stages[0].model_xml)
    assert weights["0.router_weight"] == ("f32", [128, 256])
    assert math.prod(weights["0.experts_gate_weight"][1]) == 128 * 64 * 256


# Prompts that repeat themselves (prompt lookup drafts from them) of different lengths, with different budgets;
# in every family below each greedy step's best logit leads the next by >= 2e-3 (no near-tie that paged and
# stateful float sums may order differently)
JOBS = (([2, 17, 42, 17, 42, 17, 42], 40), ([2, 9, 33, 9, 33, 9], 28), ([2, 100, 3, 100, 3, 100], 34),
        ([2, 8, 8, 8, 8, 8, 8, 8, 8], 22))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3", "llama4_text"])
def test_batched_and_speculative_streams_over_worker_processes_equal_plain_greedy(tmp_path: Path,
                                                                                 family: str) -> None:
    """A 2-stage fp32 MoE bundle (Qwen3-MoE; GLM-4.5's block; DeepSeek-V3's latent attention; Llama 4, stateful)
    over `ovshard serve` processes: one stream plain and with prompt lookup (K=3, rejected drafts rewound), then
    four streams at once through the engine, plain and speculative, each give the one-stage in-process greedy
    tokens, which test_families ties to HF; drafts were proposed and the engine's ticks carried several rows."""
    checkpoint = write_random_checkpoint(FAMILIES[family], tmp_path / "ckpt")
    one, two = compile_fp32(checkpoint, tmp_path / "b1", stages=1), compile_fp32(checkpoint, tmp_path / "b2", stages=2)
    pipe = LocalPipeline(one, config=EXACT_HINTS)
    alone = [list(pipe.generate(prompt, SamplingConfig(max_tokens=n))) for prompt, n in JOBS]
    with local_workers(two, exact=True, threads=1) as addresses:
        head = Head(two, addresses)
        try:
            prompt, config = JOBS[0][0], SamplingConfig(max_tokens=JOBS[0][1])
            assert list(head.generate(prompt, config)) == alone[0]
            stats = Stats()
            speculation = make_speculation("prompt-lookup", 3, read_manifest(two), config=EXACT_HINTS)
            assert list(head.generate(prompt, config, stats, speculation)) == alone[0]
            assert stats.drafted > 0
            assert generate_concurrently(head, JOBS, timeout=300) == alone
            assert generate_concurrently(head, JOBS, speculation, timeout=300) == alone
            batching = head.planner_stats()
            assert batching is not None and batching.seqs > batching.ticks, batching
        finally:
            head.close()
