"""Tests of placement on measured nodes (ovshard.plan.placement) and of the node probe (ovshard.runtime.cluster.probe)."""

from __future__ import annotations

import json
import socket
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.manifest import Generation, Manifest, RuntimeHints, Source, StageEntry
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import OvshardError, PlanError
from ovshard.frontend.arch import ARCHITECTURES
from ovshard.frontend.description import describe
from ovshard.frontend.tensors import mla_shapes
from ovshard.plan.costs import model_costs
from ovshard.plan.partition import plan_layers
from ovshard.plan.placement import HEADROOM, NodeProbe, Placement, plan_placement
from ovshard.runtime.cluster.probe import (
    EchoServer,
    build_probe_layer,
    free_memory_bytes,
    probe_layer,
    round_trip_s,
)
from ovshard.tools.shapes import family_config

GB = 10**9
CTX = 4096


@pytest.fixture(scope="module")
def dims(stories: Path) -> ModelDims:
    """stories260K's dimensions with a 32-token vocabulary, so the head weighs 1/40 of a layer."""
    return replace(describe(json.loads((stories / "config.json").read_text())).dims, vocab_size=32)


def make_manifest(dims: ModelDims, layers: int = 8, ranges: list[tuple[int, int]] | None = None,
                  fmt: WeightFormat | None = None) -> Manifest:
    """A manifest of ``layers`` layers split into ``ranges`` (default: one layer a stage), planned as compile does."""
    dims, fmt = replace(dims, num_layers=layers), fmt or WeightFormat("fp32")
    ranges = ranges or [(i, i + 1) for i in range(layers)]
    plan = plan_layers(model_costs(ARCHITECTURES[dims.model_type], dims, fmt), ranges, CTX)
    entries = tuple(StageEntry(s, f"stage{s.index}.xml", f"stage{s.index}.bin", {}, (), (), ()) for s in plan.specs)
    source = Source("synthetic", "sha256:0", dims.model_type, "torchscript")
    return Manifest(source, dims, fmt, plan, entries, (), None, Generation(1, (2,)), RuntimeHints(512))


def probe(node: str, ms_per_gb: float = 100.0, free: int = 64 * GB) -> NodeProbe:
    return NodeProbe(node, f"host-{node}", ms_per_gb / 1e12, free)


def layer_counts(placement: Placement) -> dict[str, int]:
    return {n: b - a for n, (a, b) in zip(placement.nodes, placement.ranges, strict=True)}


def test_a_faster_node_gets_more_layers(dims: ModelDims) -> None:
    """Of 8 one-layer stages, a node twice as fast as the other gets about two thirds (5 or 6 layers)."""
    placement = plan_placement(make_manifest(dims), [probe("A", 100), probe("B", 200)], head="A")
    counts = layer_counts(placement)
    assert sorted(counts) == ["A", "B"] and counts["A"] in (5, 6) and sum(counts.values()) == 8
    assert placement.slowest_step_s == max(placement.step_s)
    assert placement.ranges[0][0] == 0 and placement.ranges[-1][1] == 8


def test_equal_nodes_split_evenly(dims: ModelDims) -> None:
    """Four equal nodes get two layers each, in contiguous ranges that tile the model."""
    placement = plan_placement(make_manifest(dims), [probe(n) for n in "ABCD"], head="A")
    assert placement.ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert placement.groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and placement.left_out == ()


def test_placed_stages_are_runs_of_the_bundles_stages(dims: ModelDims) -> None:
    """With the bundle cut [0, 3) [3, 4) [4, 8), two equal nodes can only cut at layer 3 or 4."""
    manifest = make_manifest(dims, ranges=[(0, 3), (3, 4), (4, 8)])
    placement = plan_placement(manifest, [probe("A"), probe("B")], head="A")
    assert placement.ranges == ((0, 4), (4, 8)) and placement.groups == ((0, 1), (2,))


def test_a_far_too_slow_node_is_left_out_with_its_reason(dims: ModelDims) -> None:
    """A node 100x slower holds no stage, and left_out names it with both predictions and its probe."""
    placement = plan_placement(make_manifest(dims), [probe("A"), probe("B"), probe("S", 10_000)], head="A")
    assert set(placement.nodes) == {"A", "B"}
    [(node, message)] = placement.left_out
    assert node == "S" and message.startswith("node S (host host-S) left out: with it the slowest stage")
    assert f"without it {placement.slowest_step_s * 1e3:.2f} ms" in message and "10000.0 ms per GB" in message


def test_memory_keeps_layers_off_a_fast_node_with_little_memory(dims: ModelDims) -> None:
    """A node 4x faster with room for two layers gets two, within 90% of its free memory."""
    manifest = make_manifest(dims)
    layer = manifest.plan.stages[1].memory_bytes
    fast = probe("F", 25, free=int(2.5 * layer / HEADROOM))
    placement = plan_placement(manifest, [fast, probe("S", 100)], head="F")
    counts = layer_counts(placement)
    assert counts == {"F": 2, "S": 6}
    assert placement.memory_bytes[placement.nodes.index("F")] <= fast.usable_bytes
    unlimited = plan_placement(manifest, [probe("F", 25), probe("S", 100)], head="F")
    assert layer_counts(unlimited)["F"] >= 6


def test_a_model_that_fits_nowhere_names_the_shortfall(dims: ModelDims) -> None:
    """When no split fits, the PlanError names the node overflowed, by how much, and what to do."""
    manifest = make_manifest(dims)
    small = manifest.plan.stages[1].memory_bytes  # one layer's worth each: 8 layers on 2 nodes cannot fit
    with pytest.raises(PlanError, match=r"overflows node [AB] \(host host-[AB]\) by .*fewer context tokens"):
        plan_placement(manifest, [probe("A", free=small), probe("B", free=small)], head="A")


def test_a_node_that_makes_nothing_faster_is_left_out(dims: ModelDims) -> None:
    """Bundle stages [0, 4) [4, 5) [5, 8) and a node C with room for one layer: C could take only [4, 5), which
    leaves the slowest stage as slow, so the two-node plan wins and C's reason says so."""
    manifest = make_manifest(dims, ranges=[(0, 4), (4, 5), (5, 8)])
    small = probe("C", free=int(1.5 * manifest.plan.stages[1].memory_bytes / HEADROOM))
    placement = plan_placement(manifest, [probe("A"), probe("B"), small], head="A")
    assert placement.nodes == ("A", "B") and placement.ranges == ((0, 4), (4, 8))
    [(node, message)] = placement.left_out
    assert node == "C" and message.endswith("one without it uses fewer nodes (2, with it at least 3)")


def test_a_fixed_stage_count_uses_that_many_nodes(dims: ModelDims) -> None:
    """stages=2 on three equal nodes uses two of them and says why the third holds nothing."""
    placement = plan_placement(make_manifest(dims), [probe(n) for n in "ABC"], head="A", stages=2)
    assert len(placement.nodes) == 2 and placement.ranges == ((0, 4), (4, 8))
    assert [n for n, _ in placement.left_out] == sorted(set("ABC") - set(placement.nodes))


def test_more_stages_than_nodes_is_refused(dims: ModelDims) -> None:
    """stages=3 on two nodes is a PlanError pointing at --placement bundle."""
    with pytest.raises(PlanError, match=r"3 stages on 2 nodes.*--placement bundle"):
        plan_placement(make_manifest(dims), [probe("A"), probe("B")], head="A", stages=3)


def test_more_stages_than_the_bundle_has_is_refused(dims: ModelDims) -> None:
    """stages=3 on a 2-stage bundle is a PlanError saying to recompile with more stages."""
    manifest = make_manifest(dims, ranges=[(0, 4), (4, 8)])
    with pytest.raises(PlanError, match=r"bundle has 2 stages.*ovshard compile --stages 3"):
        plan_placement(manifest, [probe(n) for n in "ABC"], head="A", stages=3)


def test_round_trips_choose_the_order_when_times_tie(dims: ModelDims) -> None:
    """Equal nodes tie on time in every order; the chain H -> A -> B -> C -> H (1 ms a hop) wins over 10 ms hops."""
    near = {("H", "A"), ("A", "B"), ("B", "C"), ("C", "H")}
    rtt = {(u, v): (1e-3 if (u, v) in near else 10e-3) for u in "HABC" for v in "HABC" if u != v}
    placement = plan_placement(make_manifest(dims, layers=9), [probe(n) for n in "CAB"], head="H", rtt_s=rtt)
    assert placement.nodes in (("A", "B", "C"), ("C", "B", "A"))
    assert placement.round_trip_s == pytest.approx(4e-3)
    assert placement.token_s == pytest.approx(sum(placement.step_s) + 4e-3)


def test_many_nodes_follow_the_nearest_neighbour_chain(dims: ModelDims) -> None:
    """Beyond six nodes the order is nearest neighbour from the head: here H, n0, n1, ... n7."""
    nodes = [f"n{i}" for i in range(8)]
    chain = ["H", *nodes]
    rtt = {(u, v): 1e-3 * abs(chain.index(u) - chain.index(v)) for u in chain for v in chain if u != v}
    probes = [probe(n) for n in reversed(nodes)]
    placement = plan_placement(make_manifest(dims), probes, head="H", rtt_s=rtt)
    assert placement.nodes == tuple(nodes) and placement.ranges == tuple((i, i + 1) for i in range(8))


def test_even_gives_equal_layer_counts_in_the_given_order(dims: ModelDims) -> None:
    """"even" gives 2 layers to each of 4 unequal nodes, head's node first, and still predicts their steps."""
    probes = [probe("A", 100), probe("B", 400), probe("C", 50), probe("D", 200)]
    manifest = make_manifest(dims)
    placement = plan_placement(manifest, probes, head="C", strategy="even")
    assert placement.nodes == ("C", "A", "B", "D") and placement.ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert placement.step_s[2] == pytest.approx(4 * placement.step_s[1])  # B's middle layers take 4x A's
    measured = plan_placement(manifest, probes, head="C")
    assert measured.slowest_step_s < placement.slowest_step_s


def test_the_table_has_one_row_a_stage(dims: ModelDims) -> None:
    """format_table prints a header and one row per placed stage with node, host, layers and ms."""
    placement = plan_placement(make_manifest(dims), [probe("A"), probe("B")], head="A")
    lines = placement.format_table().splitlines()
    assert lines[0].split()[:5] == ["stage", "node", "host", "layers", "predicted"] and len(lines) == 3
    assert lines[1].split()[:4] == ["0", "A", "host-A", "[0,"]


def probe_manifest(dims: ModelDims, fmt: WeightFormat) -> Manifest:
    """A 2-layer manifest of hidden 256 (8 heads, 4 KV heads of 32), intermediate 768, in ``fmt``."""
    shape = replace(dims, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768)
    return make_manifest(shape, layers=2, fmt=fmt)


def matrix_bytes(out_f: int, in_f: int, fmt: WeightFormat) -> int:
    if fmt.mode == "fp32":
        return out_f * in_f * 4
    groups = out_f * in_f // fmt.group_size  # u4 weights, an f16 scale and (asym) a u4 zero point per group
    return out_f * in_f // 2 + groups * 2 + (groups + 1) // 2 * (fmt.mode == "int4_asym")


@pytest.mark.parametrize("fmt", [WeightFormat("fp32"), WeightFormat("int4_asym", 128), WeightFormat("int4_sym", 64)],
                         ids=lambda f: f.mode)
def test_probe_times_a_layer_of_the_bundles_shape(dims: ModelDims, fmt: WeightFormat) -> None:
    """probe_layer times a positive step and counts the layer's stored bytes exactly as its shapes say."""
    manifest = probe_manifest(dims, fmt)
    found = probe_layer(manifest, threads=1, steps=3, context=16)
    shapes = [(256, 256), (128, 256), (128, 256), (256, 256), (768, 256), (768, 256), (256, 768)]
    expected = sum(matrix_bytes(n, k, fmt) for n, k in shapes) + 2 * 256 * 4  # two f32 norm scales
    assert found["layer_bytes"] == expected and found["step_s"] > 0 and found["threads"] == 1
    assert found["seconds_per_byte"] == pytest.approx(found["step_s"] / expected)
    assert 0 < found["free_bytes"] and free_memory_bytes() > 0


@pytest.mark.parametrize("mode, precision", [("fp32", "float"), ("fp16", "float"), ("int8", "u8"), ("int4_asym", "u4"),
                                             ("int4_sym", "i4")])
def test_probe_weights_compile_to_compressed_fully_connected(dims: ModelDims, mode: str, precision: str) -> None:
    """The CPU plugin turns all 7 projections into FullyConnected reading the format's stored type.

    Float weights run in the plugin's own float precision: f32 on AVX512-BF16 without AMX, bf16 with AMX.
    """
    manifest = probe_manifest(dims, WeightFormat(mode))
    layer = build_probe_layer(manifest.architecture, manifest.weights, context=16)
    runtime = ov.Core().compile_model(layer.model, "CPU").get_runtime_model()
    fcs = [op for op in runtime.get_ops() if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
    assert len(fcs) == 7
    found = Counter(op.get_rt_info()["runtimePrecision"].astype(str) for op in fcs)
    if precision == "float":
        assert len(found) == 1 and set(found) <= {"f32", "bf16", "f16"}, found
    else:
        assert found == {precision: 7}


@pytest.mark.parametrize("q_lora_rank", [64, 0], ids=["q-latent", "one-q"])
def test_probe_builds_latent_attention_at_the_configs_widths(q_lora_rank: int) -> None:
    """A DeepSeek-V3-style model's probe layer holds latent attention's own projections (q_a and q_b or one q,
    kv_a, kv_b, o) at the config's LoRA ranks and nope/rope widths, caches keys of nope + rope and values of
    v_head_dim per head, runs on CPU with every projection a FullyConnected, and counts the bytes those
    matrices, the MLP's and the norms take (the compiler's own shapes: ``mla_shapes``)."""
    config = family_config("deepseek_v3", hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=q_lora_rank or None, kv_lora_rank=64, qk_nope_head_dim=32,
                           qk_rope_head_dim=16, qk_head_dim=48, v_head_dim=40, intermediate_size=512)
    dims = describe(config).dims
    assert dims.mla and (dims.head_dim, dims.v_dim, dims.rope_head_dim) == (48, 40, 16)
    shapes = [*mla_shapes(dims).values(), (512, 256), (512, 256), (256, 512)]
    norms = 2 * 256 + 64 + q_lora_rank  # the layer's two, the kv latent's and the q latent's
    layer = build_probe_layer(dims, WeightFormat("fp32"), context=16)
    assert layer.layer_bytes == 4 * (sum(n * k for n, k in shapes) + norms)
    assert {name: value.shape for name, value in layer.inputs.items()} == {
        "x": (1, 1, 256), "past_key": (1, 4, 16, 48), "past_value": (1, 4, 16, 40)}
    compiled = ov.Core().compile_model(layer.model, "CPU")
    fcs = [op for op in compiled.get_runtime_model().get_ops()
           if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
    assert len(fcs) == len(shapes)
    out = compiled(layer.inputs)[0]
    assert out.shape == (1, 1, 256) and np.isfinite(out).all()
    fmt = WeightFormat("int4_sym", 32)
    found = probe_layer(make_manifest(dims, layers=2, fmt=fmt), threads=1, steps=2, context=16)
    assert found["layer_bytes"] == sum(matrix_bytes(n, k, fmt) for n, k in shapes) + 4 * norms


def test_round_trip_to_an_echo_server_is_positive() -> None:
    """round_trip_s against a loopback EchoServer gives a positive median."""
    with EchoServer("127.0.0.1") as server:
        assert 0 < round_trip_s(server.address, tries=3) < 1.0


def test_a_closed_port_says_to_open_it() -> None:
    """round_trip_s to a port nothing listens on raises OvshardError naming the address and the open port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections are refused
        with pytest.raises(OvshardError, match=rf"{address}.*must be open between nodes"):
            round_trip_s(address, timeout_s=2.0)
