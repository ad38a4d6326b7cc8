"""Each pass: what it changes in the graph, that it changes no numbers, idempotence, preconditions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovshard.bundle import names
from ovshard.bundle.stage import StageSpec
from ovshard.errors import PreconditionError
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.frontend.trace import trace_stage
from ovshard.ir.pass_manager import PassContext
from ovshard.ir.printer import graph_text
from ovshard.passes import (
    CompressWeightsPass,
    FuseProjectionsPass,
    InjectBeamIdxGatherPass,
    MakeStatefulKVPass,
    PrecomputeRotaryPass,
    WeightFormat,
    pipeline,
)
from ovshard.passes.compress_weights import float_weights
from ovshard.passes.fuse_projections import weight_of

PROMPT = np.array([[1, 403, 407, 261, 378, 14]], dtype=np.int64)  # [batch 1, seq 6]


def traced(stories: Path, index: int = 1, num_stages: int = 2, start: int = 3, end: int = 5):
    ckpt = open_checkpoint(stories)
    dims = ckpt.dims
    model = trace_stage(ckpt, StageSpec(index, num_stages, start, end))
    return model, PassContext(StageSpec(index, num_stages, start, end), dims, dims.max_position_embeddings)


def run(model: ov.Model, ctx: PassContext, steps: int = 2, **hints: str) -> list[np.ndarray]:
    """Prefill PROMPT then decode ``steps`` tokens' worth of inputs; outputs of each call, stateful or not
    (f32 compute and cache, and ``hints``: more CPU plugin properties)."""
    rng = np.random.default_rng(0)
    compiled = ov.Core().compile_model(model.clone(), "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                               "KV_CACHE_PRECISION": "f32", **hints})
    request = compiled.create_infer_request()
    d = ctx.dims
    past = {n: np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)
            for i in range(ctx.stage.start, ctx.stage.end) for n in (names.past_key(i), names.past_value(i))}
    outputs, total = [], 0
    for seq in (PROMPT.shape[1],) + (1,) * steps:
        x = rng.standard_normal((1, seq, d.hidden_size)).astype(np.float32)  # [batch, seq, hidden]
        total += seq
        feed = {names.HIDDEN_STATES: x, names.ATTENTION_MASK: np.ones((1, total), np.int64),
                names.POSITION_IDS: np.arange(total - seq, total)[None], names.BEAM_IDX: np.zeros(1, np.int32)}
        inputs = {k: v for k, v in {**feed, **past}.items() if k in {n for p in compiled.inputs for n in p.names}}
        result = request.infer(inputs)
        outputs.append(result[compiled.output(0)].copy())
        for i in range(ctx.stage.start, ctx.stage.end):
            for name, present in ((names.past_key(i), names.present_key(i)),
                                  (names.past_value(i), names.present_value(i))):
                if present in {n for p in compiled.outputs for n in p.names}:
                    past[name] = result[present].copy()
    return outputs


def run_until(model: ov.Model, ctx: PassContext, last: type) -> ov.Model:
    for p in pipeline(WeightFormat("fp32")):
        model = p(model, ctx).model
        ctx.history.append(p.name)
        if isinstance(p, last):
            return model
    raise AssertionError(last)


@pytest.mark.parametrize("pass_type", [PrecomputeRotaryPass, MakeStatefulKVPass, InjectBeamIdxGatherPass])
def test_pass_changes_no_numbers(stories: Path, pass_type: type) -> None:
    """Outputs over a prefill and two decode steps are equal (f32) before and after each graph rewrite."""
    model, ctx = traced(stories)
    previous = {MakeStatefulKVPass: PrecomputeRotaryPass, InjectBeamIdxGatherPass: MakeStatefulKVPass}
    before_pass = run_until(model, ctx, previous[pass_type]) if pass_type in previous else model
    before = run(before_pass, ctx)
    after = run(pass_type()(before_pass.clone(), ctx).model, ctx)
    for step, (a, b) in enumerate(zip(before, after, strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"call {step} differs")


@pytest.mark.parametrize(("fmt", "untouched"), [(WeightFormat("int4_asym", group_size=32), {"SplitZeroPointsPass"}),
                                               (WeightFormat("int4_affine", group_size=32, budget=1.0), set())],
                         ids=["int4_asym", "int4_affine"])
def test_every_pass_is_idempotent(stories: Path, fmt: WeightFormat, untouched: set[str]) -> None:
    """A second run of each pass, right after the first, reports modified=False and leaves the text equal (a pass
    with nothing to rewrite in the format, ``untouched``, reports modified=False on its first run too)."""
    model, ctx = traced(stories)
    for p in pipeline(fmt):
        first = p(model, ctx)
        assert first.modified == (p.name not in untouched), f"{p.name}: modified={first.modified} on its first run"
        text = graph_text(first.model)
        second = p(first.model, ctx)
        assert not second.modified, f"{p.name} reported a change on its second run"
        assert graph_text(second.model) == text
        model = second.model
        ctx.history.append(p.name)


def test_each_pass_keeps_its_in_place_promise(stories: Path) -> None:
    """An in-place pass returns the very model it was given (so the pass manager clones before it when a failure
    dump needs the graph as it was); any other pass leaves its input's graph as it was."""
    model, ctx = traced(stories)
    for p in pipeline(WeightFormat("int4_asym", group_size=32)):
        before = graph_text(model)
        result = p(model, ctx)
        if p.in_place:
            assert result.model is model, f"{p.name} says in_place but returned another model"
        else:
            assert graph_text(model) == before, f"{p.name} says not in_place but changed its input"
        model = result.model
        ctx.history.append(p.name)


def test_precompute_rotary_replaces_trig_by_table_gather(stories: Path) -> None:
    """After the pass no Cos/Sin remain; two Gathers read constant tables [max_positions, ...] by position_ids."""
    model, ctx = traced(stories)
    assert {"Cos", "Sin"} <= {op.get_type_name() for op in model.get_ordered_ops()}
    model = PrecomputeRotaryPass()(model, ctx).model
    ops = model.get_ordered_ops()
    assert not {"Cos", "Sin"} & {op.get_type_name() for op in ops}
    lookups = [op for op in ops if op.get_type_name() == "Gather"
               and names.POSITION_IDS in op.input_value(1).get_names()]
    assert len(lookups) == 2
    for op in lookups:
        assert op.input_value(0).get_node().get_type_name() == "Constant"
        assert op.input_value(0).get_shape()[0] == ctx.max_positions


def test_make_stateful_kv_gives_each_readvalue_an_empty_initializer(stories: Path) -> None:
    """KV I/O becomes ReadValue/Assign pairs; each ReadValue's initializer is [batch, kv_heads, 0, head_dim]."""
    model, ctx = traced(stories)
    model = run_until(model, ctx, MakeStatefulKVPass)
    reads = [op for op in model.get_ordered_ops() if op.get_type_name() == "ReadValue"]
    assert sorted(r.get_attributes()["variable_id"] for r in reads) == [
        "past_key_values.3.key", "past_key_values.3.value", "past_key_values.4.key", "past_key_values.4.value"]
    for r in reads:
        init = r.input_value(0).get_partial_shape()
        assert str(init) == f"[?,{ctx.dims.num_kv_heads},0,{ctx.dims.head_dim}]"
    assert sorted(a.get_attributes()["variable_id"] for a in model.get_sinks()) == sorted(
        r.get_attributes()["variable_id"] for r in reads)
    assert not [p for p in model.inputs if any(n.startswith("past_key_values") for n in p.names)]


def test_inject_beam_idx_puts_an_i32_gather_directly_on_each_readvalue(stories: Path) -> None:
    """beam_idx is an i32 [?] Parameter; every ReadValue feeds only Gather(axis 0), which feeds the KV Concat."""
    model, ctx = traced(stories)
    model = run_until(model, ctx, InjectBeamIdxGatherPass)
    beam = [p for p in model.get_parameters() if names.BEAM_IDX in p.output(0).get_names()]
    assert len(beam) == 1 and beam[0].get_output_element_type(0) == ov.Type.i32
    for read in (op for op in model.get_ordered_ops() if op.get_type_name() == "ReadValue"):
        readers = [t.get_node() for t in read.output(0).get_target_inputs()]
        assert [r.get_type_name() for r in readers] == ["Gather"]
        assert names.BEAM_IDX in readers[0].input_value(1).get_names()
        assert "Concat" in [t.get_node().get_type_name() for t in readers[0].output(0).get_target_inputs()]


def test_inject_beam_idx_requires_state(stories: Path) -> None:
    """Run before MakeStatefulKVPass, the pass raises naming the stage, the passes run so far and the fix."""
    model, ctx = traced(stories)
    ctx.history.append("PrecomputeRotaryPass")
    with pytest.raises(PreconditionError, match=r"stage 1, InjectBeamIdxGatherPass \(after passes \[PrecomputeRotaryPass\]\)"
                       r".*run MakeStatefulKVPass first"):
        InjectBeamIdxGatherPass()(model, ctx)


@pytest.mark.parametrize("mode,storage", [("fp16", "f16"), ("int8", "u8"), ("int4_asym", "u4"), ("int4_sym", "i4")])
def test_compress_weights_stores_weights_in_the_chosen_type(stories: Path, mode: str, storage: str) -> None:
    """No f32 weight is left, the format's storage type appears; fp16/int8 outputs stay close to fp32."""
    model, ctx = traced(stories)
    model = run_until(model, ctx, InjectBeamIdxGatherPass)
    reference = run(model, ctx)
    compressed = CompressWeightsPass(WeightFormat(mode, group_size=32))(model.clone(), ctx).model
    weight_types = Counter(
        op.get_output_element_type(0).get_type_name() for op in compressed.get_ordered_ops()
        if op.get_type_name() == "Constant" and op.get_output_size() == 1 and op.get_byte_size() >= 1024
        and op.get_output_element_type(0) != ov.Type.f32)
    assert storage in weight_types, weight_types
    assert float_weights(compressed) == []
    if mode in ("fp16", "int8"):
        for a, b in zip(reference, run(compressed, ctx), strict=True):
            relative = np.linalg.norm(b - a) / np.linalg.norm(a)
            assert relative < {"fp16": 1e-3, "int8": 0.1}[mode], f"relative L2 error {relative:.2e}"


def _compressed(stories: Path, fmt: WeightFormat) -> tuple[ov.Model, PassContext]:
    model, ctx = traced(stories)
    model = CompressWeightsPass(fmt)(model, ctx).model
    ctx.history.append("CompressWeightsPass")
    return model, ctx


def _weight_matmuls(model: ov.Model) -> list[ov.Node]:
    return [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
            and op.input_value(1).get_node().get_type_name() != "Parameter"
            and op.get_input_partial_shape(1).rank.get_length() == 2
            and not op.input_value(1).get_partial_shape().is_dynamic]


@pytest.mark.parametrize("fmt", [WeightFormat("fp32"), WeightFormat("fp16"), WeightFormat("int8"),
                                 WeightFormat("int4_sym", group_size=32, budget=1.0),
                                 WeightFormat("int4_asym", group_size=-1, budget=1.0)], ids=lambda f: f.mode)
def test_fuse_projections_stacks_qkv_and_gate_up_without_changing_numbers(stories: Path, fmt: WeightFormat) -> None:
    """q/k/v and gate/up become one MatMul each (4 weight MatMuls a layer instead of 7), with the outputs of a
    prefill and two decode steps equal to the unfused stage's, in every weight format."""
    model, ctx = _compressed(stories, fmt)
    before = run(model, ctx)
    layers, head = ctx.stage.end - ctx.stage.start, int(ctx.stage.last)  # the last stage's lm_head stays alone
    assert len(_weight_matmuls(model)) == 7 * layers + head
    fused = FuseProjectionsPass()(model.clone(), ctx).model
    assert len(_weight_matmuls(fused)) == 4 * layers + head
    assert Counter(op.get_type_name() for op in fused.get_ordered_ops())["VariadicSplit"] == 2 * layers
    for step, (a, b) in enumerate(zip(before, run(fused, ctx), strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, err_msg=f"call {step} differs")


def test_fuse_projections_leaves_a_weight_stored_otherwise_on_its_own(stories: Path) -> None:
    """A q projection the INT8 budget kept INT8 beside INT4 k and v stays its own MatMul; k and v still fuse."""
    model, ctx = _compressed(stories, WeightFormat("int4_sym", group_size=32, budget=1.15, int8_weights=("3.q",)))
    fused = FuseProjectionsPass()(model, ctx).model
    stored = sorted(weight_of(op).stored.get_friendly_name() for op in _weight_matmuls(fused)  # type: ignore[union-attr]
                    if "layers.0." in weight_of(op).stored.get_friendly_name())  # type: ignore[union-attr]
    assert "self.layers.0.q_weight" in stored, stored  # the stage's first layer is the model's layer 3
    assert any("k_weight" in n and "v_weight" in n and "q_weight" not in n for n in stored), stored


def test_fuse_projections_requires_compressed_weights(stories: Path) -> None:
    """Run before CompressWeightsPass (which chooses each projection's format alone), the pass refuses, naming it."""
    model, ctx = traced(stories)
    with pytest.raises(PreconditionError, match="CompressWeightsPass first"):
        FuseProjectionsPass()(model, ctx)


def test_fused_projections_reach_the_cpu_plugin_as_one_fully_connected_node(stories: Path) -> None:
    """The compiled runtime graph of an INT4 stage runs 4 fully connected nodes a layer instead of 7."""
    counts = {}
    for fuse_them in (False, True):
        model, ctx = _compressed(stories, WeightFormat("int4_sym", group_size=32, budget=1.0))
        if fuse_them:
            model = FuseProjectionsPass()(model, ctx).model
        runtime = ov.Core().compile_model(model, "CPU").get_runtime_model()
        counts[fuse_them] = sum(op.get_rt_info()["layerType"].astype(str).startswith("FullyConnected")
                                for op in runtime.get_ordered_ops())
    layers, head = ctx.stage.end - ctx.stage.start, int(ctx.stage.last)
    assert (counts[False], counts[True]) == (7 * layers + head, 4 * layers + head)
