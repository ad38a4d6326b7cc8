"""Tests of the partition planner: graph shape, exact optimality, validation, parsing and round trips."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ovshard.bundle import schema
from ovshard.bundle.plan import PartitionPlan, format_bytes
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import BundleError, PlanError
from ovshard.frontend.description import describe
from ovshard.plan.costs import model_costs
from ovshard.plan.partition import (
    Block,
    ModelCosts,
    _chain,
    build_block_graph,
    parse_budgets,
    parse_layers,
    plan_balanced,
    plan_budgets,
    plan_layers,
)
from ovshard.tools.synth import preset

MiB = 2**20
GiB = 2**30


def make_costs(
    weights: Sequence[int], embed: int = 0, head: int = 0, kv: int = 0, act: int = 4096
) -> ModelCosts:
    """A model with one layer per entry of ``weights``, each adding ``kv`` KV bytes per token."""
    layers = [Block(f"layer.{i}", "layer", i, w, kv) for i, w in enumerate(weights)]
    blocks = (Block("embed", "embed", None, embed, 0), *layers, Block("head", "head", None, head, 0))
    return ModelCosts(blocks=blocks, activation_bytes_per_token=act)


def ranges_of(plan: PartitionPlan) -> list[tuple[int, int]]:
    return [s.layers for s in plan.stages]


def all_splits(num_layers: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """Every way to cut [0, num_layers) into num_stages non-empty contiguous ranges."""
    out = []
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        out.append(list(itertools.pairwise(bounds)))
    return out


def test_graph_is_a_chain_with_only_layer_to_layer_edges_cuttable() -> None:
    """The graph runs embed -> layer.0 .. layer.2 -> head and marks only the two inner edges cuttable."""
    graph = build_block_graph(make_costs([1, 2, 3], act=512))
    assert list(graph.edges) == [
        ("embed", "layer.0"),
        ("layer.0", "layer.1"),
        ("layer.1", "layer.2"),
        ("layer.2", "head"),
    ]
    cuttable = [(u, v) for u, v, c in graph.edges(data="cuttable") if c]
    assert cuttable == [("layer.0", "layer.1"), ("layer.1", "layer.2")]
    assert {a for _, _, a in graph.edges(data="activation_bytes_per_token")} == {512}


def test_graph_nodes_carry_block_costs() -> None:
    """Each node holds its block's kind, layer index, weight bytes, KV bytes per token and bytes read a step."""
    graph = build_block_graph(make_costs([10, 20], embed=5, head=7, kv=3))
    assert graph.nodes["layer.1"] == {
        "kind": "layer",
        "layer": 1,
        "weight_bytes": 20,
        "kv_bytes_per_token": 3,
        "read_bytes": None,  # all of its weight bytes
        "kv_reach": None,  # its attention reads every cached position
    }
    assert graph.nodes["embed"]["weight_bytes"] == 5
    assert graph.nodes["head"]["kind"] == "head"


def test_model_costs_rejects_blocks_out_of_chain_order() -> None:
    """ModelCosts refuses blocks that are not embed, layer.0 .. layer.N-1, head."""
    good = make_costs([1, 1])
    with pytest.raises(PlanError, match="expected blocks"):
        ModelCosts(
            blocks=(good.blocks[0], good.blocks[2], good.blocks[1], good.blocks[3]),
            activation_bytes_per_token=1,
        )


def test_balanced_splits_equal_layers_evenly() -> None:
    """Eight equal layers on four stages get two layers each."""
    plan = plan_balanced(make_costs([100 * MiB] * 8), 4)
    assert ranges_of(plan) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert plan.strategy == "balanced-reads"
    assert plan_balanced(make_costs([100 * MiB] * 8), 4, balance="memory").strategy == "balanced"


def test_balanced_ties_take_the_smallest_cut_positions() -> None:
    """When several splits are equally even, the one with the earliest cuts wins."""
    plan = plan_balanced(make_costs([100] * 7), 3)
    assert ranges_of(plan) == [(0, 2), (2, 4), (4, 7)]


def test_balanced_heavy_embed_and_head_push_layers_to_the_middle() -> None:
    """A large embedding and head leave the first and last stages fewer layers than the middle one."""
    plan = plan_balanced(make_costs([100] * 10, embed=300, head=300), 3, balance="memory")
    assert ranges_of(plan) == [(0, 2), (2, 7), (7, 10)]
    assert [s.memory_bytes for s in plan.stages] == [500, 500, 600]


def test_balanced_with_as_many_stages_as_layers_gives_one_layer_each() -> None:
    """num_stages == num_layers puts exactly one layer on each stage."""
    plan = plan_balanced(make_costs([5, 1, 9, 2, 7]), 5)
    assert ranges_of(plan) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_balanced_more_stages_than_layers_names_the_limit() -> None:
    """Asking for six stages of a five-layer model fails and says how many stages are possible."""
    with pytest.raises(PlanError) as info:
        plan_balanced(make_costs([1] * 5), 6)
    assert "asked for 6 stages but the model has 5 layers" in str(info.value)
    assert "--stages 5 or fewer" in str(info.value)


def test_balanced_zero_stages_is_refused() -> None:
    """Zero stages is not a plan."""
    with pytest.raises(PlanError, match="asked for 0 stages"):
        plan_balanced(make_costs([1] * 3), 0)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 1000), min_size=1, max_size=8),
    embed=st.integers(0, 3000),
    head=st.integers(0, 3000),
    kv=st.integers(0, 20),
    ctx=st.integers(0, 64),
    data=st.data(),
)
def test_balanced_matches_brute_force(
    weights: list[int], embed: int, head: int, kv: int, ctx: int, data: st.DataObject
) -> None:
    """The balanced plan is the brute-force minimum of (largest memory, sum of squares, cut positions); by
    reads, of the same over each stage's bytes read a step (weights, and one sequence's KV at the context)."""
    costs = make_costs(weights, embed=embed, head=head, kv=kv)
    n = data.draw(st.integers(1, len(weights)), label="num_stages")
    chain = _chain(costs)

    def key(ranges: list[tuple[int, int]]) -> tuple[int, int, list[tuple[int, int]]]:
        memories = [s.memory_bytes for s in plan_layers(costs, ranges, ctx).stages]
        return max(memories), sum(m * m for m in memories), ranges

    def reads_key(ranges: list[tuple[int, int]]) -> tuple[int, int, list[tuple[int, int]]]:
        reads = [chain.reads(i, len(ranges), a, b, chain.kv_reads(ctx)) for i, (a, b) in enumerate(ranges)]
        return max(reads), sum(r * r for r in reads), ranges

    assert ranges_of(plan_balanced(costs, n, ctx, "memory")) == min(all_splits(len(weights), n), key=key)
    assert ranges_of(plan_balanced(costs, n, ctx)) == min(all_splits(len(weights), n), key=reads_key)


def test_stage_bytes_count_embed_head_kv_and_cut_activations() -> None:
    """Stage 0 holds the embedding, the last stage the head, memory adds KV at context, later stages receive activations."""
    plan = plan_layers(make_costs([10, 20, 30], embed=1000, head=2000, kv=2, act=64), [(0, 1), (1, 3)], 100)
    first, last = plan.stages
    assert (first.weight_bytes, first.kv_bytes_per_token, first.memory_bytes) == (1010, 2, 1210)
    assert (last.weight_bytes, last.kv_bytes_per_token, last.memory_bytes) == (2050, 4, 2450)
    assert (first.activation_bytes_in, last.activation_bytes_in) == (0, 64)
    assert first.budget_bytes is None


def test_plan_layers_keeps_the_given_ranges() -> None:
    """Valid explicit ranges come back unchanged, under the "layers" strategy."""
    plan = plan_layers(make_costs([1] * 7), [(0, 3), (3, 5), (5, 7)])
    assert ranges_of(plan) == [(0, 3), (3, 5), (5, 7)]
    assert plan.strategy == "layers"


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 3), (4, 7)], "range 1 [4, 7) starts at layer 4, expected 3: layers [3, 4) are in no stage"),
        ([(0, 4), (3, 7)], "range 1 [3, 7) starts at layer 3, expected 4: layers [3, 4) are in two stages"),
        ([(0, 3), (3, 3), (3, 7)], "range 1 [3, 3) holds no layers"),
        ([(1, 7)], "range 0 [1, 7) starts at layer 1, expected 0"),
        ([(0, 3), (3, 6)], "the last range ends at layer 6, expected 7: layers [6, 7) are in no stage"),
        ([(0, 3), (3, 9)], "range 1 [3, 9) ends at layer 9, expected at most 7"),
        ([], "no ranges were given, expected 7"),
    ],
    ids=["gap", "overlap", "empty", "not-from-zero", "short", "past-end", "none"],
)
def test_plan_layers_names_the_offending_range(ranges: list[tuple[int, int]], message: str) -> None:
    """Gaps, overlaps, empty ranges and wrong ends each fail naming the range and what was expected."""
    with pytest.raises(PlanError) as info:
        plan_layers(make_costs([1] * 7), ranges)
    assert message in str(info.value)
    assert "the ranges must tile [0, 7) in order" in str(info.value)


def test_budgets_pick_the_only_fitting_split() -> None:
    """With budgets 600 MiB and 200 MiB, eight 100 MiB layers must split 6 + 2."""
    plan = plan_budgets(make_costs([100 * MiB] * 8), [600 * MiB, 200 * MiB], context_tokens=0)
    assert ranges_of(plan) == [(0, 6), (6, 8)]
    assert [s.budget_bytes for s in plan.stages] == [600 * MiB, 200 * MiB]
    assert all(s.memory_bytes <= (s.budget_bytes or 0) for s in plan.stages)


def test_budgets_minimise_the_largest_fill_ratio() -> None:
    """Among fitting splits, the one with the lowest worst memory/budget ratio wins (here 1:1 against 3:1 budgets)."""
    plan = plan_budgets(make_costs([100] * 8), [3000, 1000], context_tokens=0)
    assert ranges_of(plan) == [(0, 6), (6, 8)]


def test_budgets_infeasible_names_stage_and_overflow() -> None:
    """When nothing fits, the error gives the best-effort plan, the overflowing stage, by how much, and what to do."""
    with pytest.raises(PlanError) as info:
        plan_budgets(make_costs([GiB] * 4), [2 * GiB, GiB], context_tokens=0)
    assert str(info.value) == (
        "no split of 4 layers fits budgets 2.0 GiB, 1.0 GiB at 0 tokens of context: best plan [0, 3) [3, 4) "
        "still overflows stage 0 by 1.0 GiB (needs 3.0 GiB); raise that budget, add a node, shorten the "
        "context, or choose a smaller weight format"
    )


def test_budgets_count_kv_at_the_context_length() -> None:
    """KV bytes at the context length count against the budget: a split that fits at 0 tokens fails at 1000."""
    costs = make_costs([100] * 4, kv=1)
    assert ranges_of(plan_budgets(costs, [200, 200], context_tokens=0)) == [(0, 2), (2, 4)]
    with pytest.raises(PlanError) as info:
        plan_budgets(costs, [200, 200], context_tokens=1000)
    assert "at 1000 tokens of context" in str(info.value)
    assert "overflows stage 0 by 2.0 KiB (needs 2.1 KiB), stage 1 by 2.0 KiB" in str(info.value)
    assert "raise those budgets" in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 1000), min_size=1, max_size=7),
    embed=st.integers(0, 1000),
    head=st.integers(0, 1000),
    data=st.data(),
)
def test_budgets_match_brute_force(weights: list[int], embed: int, head: int, data: st.DataObject) -> None:
    """plan_budgets fits whenever some split fits, and then reaches the brute-force lowest worst ratio."""
    costs = make_costs(weights, embed=embed, head=head)
    n = data.draw(st.integers(1, len(weights)), label="num_stages")
    budgets = data.draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n), label="budgets")

    def worst(ranges: list[tuple[int, int]]) -> Fraction:
        stages = plan_layers(costs, ranges, 0).stages
        return max(Fraction(s.memory_bytes, b) for s, b in zip(stages, budgets, strict=True))

    best = min(worst(r) for r in all_splits(len(weights), n))
    if best > 1:
        with pytest.raises(PlanError, match="still overflows"):
            plan_budgets(costs, budgets, 0)
    else:
        assert worst(ranges_of(plan_budgets(costs, budgets, 0))) == best


def test_budgets_refuse_non_positive_and_too_many_budgets() -> None:
    """A zero budget, or more budgets than layers, is refused before planning."""
    with pytest.raises(PlanError, match="expected positive budgets"):
        plan_budgets(make_costs([1] * 3), [10, 0])
    with pytest.raises(PlanError, match="asked for 4 stages but the model has 3 layers"):
        plan_budgets(make_costs([1] * 3), [10] * 4)


def test_parse_layers_reads_half_open_ranges() -> None:
    """ "0:3,3:5,5:7" parses to three half-open ranges, spaces allowed around items."""
    assert parse_layers("0:3,3:5,5:7") == [(0, 3), (3, 5), (5, 7)]
    assert parse_layers(" 0:2 , 2:4") == [(0, 2), (2, 4)]


@pytest.mark.parametrize("text", ["", "0-3", "0:3,", "a:b", "0:3;3:5", "-1:3", "0:3:5"])
def test_parse_layers_rejects_malformed_text(text: str) -> None:
    """Anything but comma-separated start:end integers fails and shows the expected form."""
    with pytest.raises(PlanError, match="such as 0:3,3:5,5:7"):
        parse_layers(text)


def test_parse_budgets_reads_decimal_and_binary_units() -> None:
    """GB is 10**9 bytes, GiB 2**30, MiB 2**20, KB 1000, bare numbers are bytes; units ignore case."""
    assert parse_budgets("2GB,2GB,512MiB,1.5GiB,1000000") == [
        2 * 10**9,
        2 * 10**9,
        512 * MiB,
        3 * GiB // 2,
        10**6,
    ]
    assert parse_budgets("10 KB, 4kib, 1mb, 7B") == [10_000, 4096, 10**6, 7]


@pytest.mark.parametrize("text", ["", "2XB", "GB", "1.5.5GB", "-1GB", "2GB,,1GB"])
def test_parse_budgets_rejects_malformed_sizes(text: str) -> None:
    """Unknown units, missing numbers and empty items fail and list the accepted units."""
    with pytest.raises(PlanError, match="units B, KB, KiB"):
        parse_budgets(text)


def test_parse_budgets_rejects_zero() -> None:
    """A zero-byte budget is refused."""
    with pytest.raises(PlanError, match="expected a positive size"):
        parse_budgets("1GB,0MiB")


def test_plan_round_trips_through_json() -> None:
    """The plan encodes to JSON in field order, and the strict decoder rebuilds an equal plan."""
    plan = plan_budgets(make_costs([100] * 6, embed=50, head=70, kv=1), [1000, 1000], context_tokens=16)
    d = json.loads(json.dumps(schema.encode(plan)))
    assert list(d) == ["strategy", "context_tokens", "stages"]
    assert d["stages"][1]["stage"] == {"index": 1, "num_stages": 2, "start": 3, "end": 6}
    assert schema.decode(PartitionPlan, d, "plan") == plan


def test_decoding_a_plan_without_a_field_names_the_key() -> None:
    """A plan without a stage field fails with BundleError naming where and which key."""
    d = schema.encode(plan_balanced(make_costs([1] * 4), 2))
    del d["stages"][1]["memory_bytes"]
    with pytest.raises(BundleError, match=r"plan\.stages\[1\]: the key 'memory_bytes' is missing"):
        schema.decode(PartitionPlan, d, "plan")


def test_format_table_lists_every_stage_range_and_a_total() -> None:
    """The table has a header, one row per stage with its range, and a total row over [0, L)."""
    plan = plan_balanced(make_costs([300 * MiB] * 6, embed=500 * MiB, head=500 * MiB), 3)
    lines = plan.format_table().splitlines()
    assert len(lines) == 2 + len(plan.stages)
    assert "memory @ 4096" in lines[0]
    for line, (start, end) in zip(lines[1:-1], ranges_of(plan), strict=True):
        assert f"[{start}, {end})" in line
    assert lines[-1].startswith("total") and "[0, 6)" in lines[-1] and "2.7 GiB" in lines[-1]


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (int(310.5 * MiB), "310.5 MiB"), (2 * GiB, "2.0 GiB")],
)
def test_format_bytes_uses_binary_units(n: int, text: str) -> None:
    """Sizes print in B, KiB, MiB or GiB with one decimal."""
    assert format_bytes(n) == text


# The planner's weights of real models: bytes from the family's tensor table, no weights read

PUBLIC_PARAMETERS = {  # the parameter counts the model cards (safetensors metadata) give
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
    "phi-3-mini": 3_821_079_552,
    "phi-4-mini": 3_836_021_760,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-3-270m": 268_098_176,
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 3_880_263_168,  # the language model; the SigLIP tower adds ~0.42e9 (4.30e9 in all)
}


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMETERS))
def test_model_costs_weigh_real_models_at_their_public_parameter_count(name: str) -> None:
    """In fp32 the planner's blocks weigh 4 bytes a parameter of the public model (a tied head counted twice)."""
    model = describe(preset(name))
    dims = model.dims
    costs = model_costs(model.arch, dims, WeightFormat("fp32"))
    total = sum(b.weight_bytes for b in costs.blocks)
    table = dims.vocab_size * dims.hidden_size
    assert total == 4 * (PUBLIC_PARAMETERS[name] + (table if dims.tie_word_embeddings else 0))
    layers = [b for b in costs.blocks if b.kind == "layer"]
    assert len(layers) == dims.num_layers and len({b.weight_bytes for b in layers}) == 1
    # the KV cache at u8 (a new bundle's hint): keys 1.25 bytes a dim (a block of 32 positions shares an f32
    # scale and zero point a channel), values a byte a dim and 8 bytes a token (its scale and zero point)
    assert all(b.kv_bytes_per_token == dims.num_kv_heads * (dims.head_dim * 5 // 4 + dims.head_dim + 8) for b in layers)


def test_model_costs_count_fused_and_per_head_tensors() -> None:
    """Phi-3's fused qkv/gate_up and Qwen3's per-head q/k norms weigh what the separate tensors would."""
    def layer_bytes(config: dict) -> int:
        model = describe(config)
        return model_costs(model.arch, model.dims, WeightFormat("fp32")).blocks[1].weight_bytes

    phi = preset("phi-3-mini")
    as_llama = preset("llama-3.1-8b", hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                      head_dim=96, intermediate_size=8192)
    assert layer_bytes(phi) == layer_bytes(as_llama)
    qwen3 = preset("qwen3-8b")
    without_qk_norm = preset("llama-3.1-8b", intermediate_size=12288)
    assert layer_bytes(qwen3) == layer_bytes(without_qk_norm) + 4 * 2 * 128


def test_a_tied_embedding_is_counted_once_in_a_one_stage_plan() -> None:
    """One stage stores a tied embedding and lm_head as one constant; two stages store it in each end stage."""
    model = describe(preset("gemma-3-270m"))
    dims = model.dims
    costs = model_costs(model.arch, dims, WeightFormat("fp32"))
    total, table = sum(b.weight_bytes for b in costs.blocks), 4 * dims.vocab_size * dims.hidden_size
    one = plan_balanced(costs, 1, 0).stages[0]
    assert one.weight_bytes == total - table
    assert sum(s.weight_bytes for s in plan_balanced(costs, 2, 0).stages) == total


def test_the_planned_size_of_a_tied_one_stage_bundle_is_its_stored_size(stories, tmp_path) -> None:
    """The real stories260K (tied) in one fp32 stage: the plan's bytes within 1% of the stage's .bin file."""
    from conftest import compile_fp32

    from ovshard.bundle.manifest import read_manifest

    bundle = compile_fp32(stories, tmp_path / "b", stages=1)
    manifest = read_manifest(bundle)
    planned, stored = manifest.plan.stages[0].weight_bytes, (bundle / manifest.stages[0].model_bin).stat().st_size
    assert abs(planned - stored) <= 0.01 * stored, (planned, stored)


def test_balance_by_reads_gives_the_lm_head_stage_fewer_layers() -> None:
    """The Llama-3.2-1B shape (tied 128K embedding, INT4): by memory the two ends weigh alike and the layers
    split 8/8; by reads (the default) stage 1 also reads the lm_head every step, so stage 0 takes more layers
    and the largest stage's reads drop."""
    model = describe(preset("llama-3.2-1b"))
    costs = model_costs(model.arch, model.dims, WeightFormat())
    memory, reads = plan_balanced(costs, 2, 0, "memory"), plan_balanced(costs, 2, 0)
    assert [s.layers for s in memory.stages] == [(0, 8), (8, 16)]
    assert reads.stages[0].layers[1] > 8, reads.format_table()
    chain = _chain(costs)

    def worst(plan: PartitionPlan) -> int:
        return max(chain.reads(s.index, 2, *s.layers) for s in plan.stages)

    assert worst(reads) < worst(memory)
    with pytest.raises(PlanError, match="expected reads"):
        plan_balanced(costs, 2, 0, "speed")
    fits = plan_budgets(costs, [2 << 30, 2 << 30], 0, "reads")
    assert [s.layers for s in fits.stages] == [s.layers for s in reads.stages]


def test_balance_by_reads_counts_the_kv_cache_a_step_reads() -> None:
    """A step's attention reads every cached position of its layers: SmolLM2-135M's shape (576 wide, 3 KV heads
    of 64: 456 bytes of u8 KV a token a layer, against 2.2 MB of INT4 weights) caches about its weights' bytes
    a layer at 4,096 tokens, so by reads at that context the last stage, which also reads the INT8 lm_head,
    takes more layers than by weights alone; the Llama-3.2-1B shape (a layer's weights about 8x its KV at 4,096
    tokens) keeps its cut, and the same context counts in the budgets' reads."""
    small = describe(preset("llama-3.2-1b", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152))
    costs = model_costs(small.arch, small.dims, WeightFormat(mode="int4_affine", group_size=32, budget=1.0))
    weights_only, at_4k = plan_balanced(costs, 2, 4096, read_context=0), plan_balanced(costs, 2, 4096)
    assert at_4k.stages[0].layers[1] < weights_only.stages[0].layers[1], (weights_only.format_table(),
                                                                          at_4k.format_table())
    chain = _chain(costs)
    kv = chain.kv_reads(4096)
    assert (max(chain.reads(s.index, 2, *s.layers, kv) for s in at_4k.stages)
            < max(chain.reads(s.index, 2, *s.layers, kv) for s in weights_only.stages))
    fits = plan_budgets(costs, [1 << 30, 1 << 30], 4096, "reads")
    assert [s.layers for s in fits.stages] == [s.layers for s in at_4k.stages]
    model = describe(preset("llama-3.2-1b"))
    dense = model_costs(model.arch, model.dims, WeightFormat())
    assert ([s.layers for s in plan_balanced(dense, 2, 4096).stages]
            == [s.layers for s in plan_balanced(dense, 2, 4096, read_context=0).stages])


def test_kv_reads_stop_at_a_sliding_layers_window() -> None:
    """A sliding-window layer's attention reads at most its window of cached positions, a global one all."""
    blocks = (Block("embed", "embed", None, 0, 0), Block("layer.0", "layer", 0, 100, 10),
              Block("layer.1", "layer", 1, 100, 10, kv_reach=512), Block("head", "head", None, 0, 0))
    chain = _chain(ModelCosts(blocks=blocks, activation_bytes_per_token=4))
    assert chain.kv_reads(4096) == (0, 40960, 40960 + 5120)
    assert chain.kv_reads(256) == (0, 2560, 5120)
    assert chain.reads(0, 1, 0, 2, chain.kv_reads(4096)) == 200 + 46080
