"""SplitZeroPointsPass: int4_affine's f16 zero points become signed codes plus a MatMul of group sums.

The rewritten stage computes what it computed before (f32, no activation quantization), the CPU plugin then runs
each such weight as a fully connected node with signed 4-bit codes and no zero point (the int8 path), and a
weight read by another op (a table tied to the lm_head) keeps its form.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from test_passes import run, traced

from ovshard.bundle.weights import WeightFormat
from ovshard.errors import PreconditionError
from ovshard.passes import CompressWeightsPass, FuseProjectionsPass, SplitZeroPointsPass
from ovshard.passes.compress_weights import int4_affine_weight
from ovshard.passes.split_zero_points import float_zero_point_weights

AFFINE = WeightFormat("int4_affine", group_size=32, budget=1.0)


def _affine_stage(stories: Path) -> tuple[ov.Model, object]:
    model, ctx = traced(stories)
    for p in (CompressWeightsPass(AFFINE), FuseProjectionsPass()):
        model = p(model, ctx).model
        ctx.history.append(p.name)
    return model, ctx


def _fully_connected_inputs(model: ov.Model, hints: dict[str, str]) -> list[list[str]]:
    """Each FullyConnected node of the compiled runtime graph: its inputs' element types (an absent one: dynamic)."""
    runtime = ov.Core().compile_model(model, "CPU", hints).get_runtime_model()
    return [[op.input_value(i).get_element_type().get_type_name() for i in range(op.get_input_size())]
            for op in runtime.get_ordered_ops() if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]


def test_split_keeps_the_numbers_and_drops_the_float_zero_points(stories: Path) -> None:
    """A stage of int4_affine weights gives the same outputs (f32, no activation quantization) over a prefill and
    two decode steps after the pass; the plugin's fully connected nodes then read i4 codes without a zero point,
    where before they read u4 codes with float zero points."""
    model, ctx = _affine_stage(stories)
    before_nodes = _fully_connected_inputs(model.clone(), {"INFERENCE_PRECISION_HINT": "f32"})
    assert sum(inputs[1] == "u4" and inputs[4] == "f32" for inputs in before_nodes) == 3 * 2  # qkv, o, gate_up
    exact = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}  # no activation quantization: the products themselves
    before = run(model, ctx, **exact)
    result = SplitZeroPointsPass()(model, ctx)
    assert result.modified and not float_zero_point_weights(result.model)
    for step, (a, b) in enumerate(zip(before, run(result.model, ctx, **exact), strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"call {step} differs")
    after_nodes = _fully_connected_inputs(result.model, {"INFERENCE_PRECISION_HINT": "f32",
                                                         "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"})
    codes = [inputs for inputs in after_nodes if inputs[1] == "i4"]
    assert len(codes) == 3 * 2 and all(inputs[4] == "dynamic" for inputs in codes), after_nodes
    assert not any(inputs[1] == "u4" for inputs in after_nodes), after_nodes
    assert not SplitZeroPointsPass()(result.model, ctx).modified  # nothing left to split


def test_a_tied_table_keeps_its_zero_points() -> None:
    """An int4_affine table that a Gather and the lm_head both read is left as it is; an untied weight is split."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((96, 64)).astype(np.float32)
    other = rng.standard_normal((48, 64)).astype(np.float32)
    ids, x = ops.parameter([1, 3], ov.Type.i64), ops.parameter([1, 3, 64], ov.Type.f32)
    tied = int4_affine_weight("table", table.reshape(96, -1, 32), (96, 64))
    hidden = ops.add(ops.gather(tied, ids, 0), x)
    logits = ops.matmul(hidden, tied, False, True)
    side = ops.matmul(hidden, int4_affine_weight("other", other.reshape(48, -1, 32), (48, 64)), False, True)
    model = ov.Model([logits, side], [ids, x])
    assert [w.matmul.get_friendly_name() for w in float_zero_point_weights(model)] == [side.get_friendly_name()]


def test_split_requires_compressed_weights(stories: Path) -> None:
    model, ctx = traced(stories)
    with pytest.raises(PreconditionError, match="CompressWeightsPass first"):
        SplitZeroPointsPass()(model, ctx)
