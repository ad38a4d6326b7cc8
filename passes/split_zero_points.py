"""SplitZeroPointsPass: an INT4 weight with float zero points runs as its codes plus a correction of group sums.

``int4_affine`` (llama.cpp's Q4_1 blocks as they are: ``compress_weights.int4_affine_weight``) stores each group
of ``G`` weights as codes ``q`` in [0, 15], an f16 scale ``s`` and an f16 zero point ``z``: ``w = s (q - z)``. The
CPU plugin quantizes a fully connected node's activations to int8 (its dynamic quantization, the bundle's hint)
only where the weights' zero points are integers or absent; an f16 zero point keeps the node on its f32 kernel.
Since ``x . w = s (x . (q - 8)) - s (z - 8) (sum of x over the group)``, the same product is

    MatMul(x, s (q - 8)) + MatMul(group sums of x, -s (z - 8))

where the first MatMul's weights are signed 4-bit codes without a zero point (the int8 path, as int4_sym's)
and the second reads one value a group: ``x`` reshaped to [..., groups, G] and summed over the last axis, times
a [rows, groups] matrix that the plugin folds from the stored ``z`` and ``s`` at load (no byte more in the
bundle). The codes are stored signed (``q - 8``: each nibble's top bit flipped) because the int8 path rounds the
activations and the correction uses their exact sums: with codes in [0, 15] that rounding is multiplied by
codes around 7.5 and no longer cancels against the correction (a residual block's output error 1.7x larger,
a 30-block chain's 3x, measured), with codes in [-8, 7] it is what int4_sym's nodes take. Without dynamic quantization the products are the same
as before to f32 rounding.

Measured (bench/cpu_kernels/zero_points.py, docs/results/2026-12-one-node.md): SmolLM2-135M's Q4_1 GGUF compiled
by default decoded 1.2x faster on a 2-core Intel Xeon (its step 1.1-1.2x), a chain of 2048 x 8192 matrices 1.5x.

Runs after FuseProjectionsPass, so fused q/k/v and gate/up share one group sum. A weight another op also reads
(an embedding table tied to the lm_head) keeps its form.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult
from ovshard.passes.fuse_projections import Weight, weight_of

_FLOAT_ZERO_CHAIN = ("Convert", "Subtract", "Multiply", "Reshape", "Convert")  # codes -> f16 -> - z -> * s -> [n, k]


def float_zero_point_weight(matmul: ov.Node) -> Weight | None:
    """The MatMul's weight chain when it is ``s (q - z)`` with grouped u4 codes and f16 zero points; else None."""
    if matmul.get_type_name() != "MatMul":
        return None
    weight = weight_of(matmul)
    if weight is None or tuple(s.node.get_type_name() for s in weight.steps) != _FLOAT_ZERO_CHAIN:
        return None
    stored, (_, subtract, multiply, _, last) = weight.stored, weight.steps
    if (stored.get_output_element_type(0) != ov.Type.u4 or len(stored.get_output_shape(0)) != 3
            or last.node.get_output_element_type(0) != ov.Type.f32):
        return None
    for side in (subtract, multiply):
        assert side.side is not None
        if side.side_convert is not None or side.side.get_output_element_type(0) != ov.Type.f16:
            return None  # an integer zero point (NNCF's u4) takes the int8 path already
        if tuple(side.side.get_output_shape(0)) != (*stored.get_output_shape(0)[:2], 1):
            return None
    if matmul.input_value(0).get_partial_shape().rank.is_dynamic:
        return None
    return weight


def signed(stored: ov.Node) -> ov.Node:
    """The u4 codes ``q`` of ``stored`` as i4 codes ``q - 8`` (two's complement: each nibble's top bit flipped)."""
    tensor = ov.Tensor(ov.Type.i4, stored.get_output_shape(0))
    tensor.data.reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(stored.get_data()).reshape(-1).view(np.uint8) ^ 0x88
    codes = ov.op.Constant(tensor, shared_memory=False)
    codes.set_friendly_name(stored.get_friendly_name())
    return codes


def split(weight: Weight) -> None:
    """Rewrite ``weight``'s MatMul as its codes' MatMul plus the group sums' correction (the module docstring)."""
    matmul, stored = weight.matmul, weight.stored
    zero, scale = weight.steps[1].side, weight.steps[2].side
    assert zero is not None and scale is not None
    rows, groups, group = (int(d) for d in stored.get_output_shape(0))
    name = matmul.get_friendly_name()
    codes = ops.multiply(ops.convert(signed(stored), ov.Type.f16), scale, name=f"{name}/codes")
    codes = ops.reshape(codes, ops.constant(np.array([rows, groups * group], np.int64)), False)
    matmul.input(1).replace_source_output(ops.convert(codes, ov.Type.f32).output(0))

    x = matmul.input_value(0)
    rank = x.get_partial_shape().rank.get_length()
    grouped = ops.reshape(x, ops.constant(np.array([0] * (rank - 1) + [groups, group], np.int64)), True)
    sums = ops.reduce_sum(grouped, ops.constant(np.array([-1], np.int64)), False, name=f"{name}/group_sums")
    centred = ops.subtract(ops.convert(zero, ov.Type.f32), ops.constant(np.float32(8.0)))
    offsets = ops.multiply(centred, ops.convert(scale, ov.Type.f32))  # s (z - 8), exact in f32
    offsets = ops.reshape(ops.negative(offsets), ops.constant(np.array([rows, groups], np.int64)), False)
    correction = ops.matmul(sums, offsets, False, True, name=f"{name}/zero_points")
    readers = list(matmul.output(0).get_target_inputs())
    total = ops.add(matmul.output(0), correction, name=f"{name}/with_zero_points")
    for reader in readers:
        reader.replace_source_output(total.output(0))


def float_zero_point_weights(model: ov.Model) -> list[Weight]:
    return [w for w in (float_zero_point_weight(op) for op in model.get_ordered_ops()) if w is not None]


class SplitZeroPointsPass(GraphPass):
    """INT4 weights with f16 zero points: codes on the int8 path plus a correction of group sums."""

    scope = "layer"  # each weight on its own, after its layer's projections are fused

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        if "CompressWeightsPass" not in ctx.history:
            raise self.unmet(ctx, "zero points are split as stored: run CompressWeightsPass first")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        found = float_zero_point_weights(model)
        for weight in found:
            split(weight)
        if found:
            model.validate_nodes_and_infer_types()
        return PassResult(model, modified=bool(found))

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        left = float_zero_point_weights(model)
        if left:
            raise self.fail(ctx, f"{len(left)} MatMuls still read weights with f16 zero points, e.g. "
                                 f"{left[0].matmul.get_friendly_name()}")
