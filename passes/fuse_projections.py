"""FuseProjectionsPass: the projections that read one activation become one MatMul and a VariadicSplit.

q, k and v read the same normed hidden state, and so do gate and up (a shared expert's too). Stacking their
weights by output row and running one MatMul gives the same numbers (each output is still one row's dot product
with the same input: the f32 outputs of a fused stage equal the unfused ones bit for bit), and the CPU plugin
runs one ``FullyConnected`` node where it ran three: a decode step of a small model is dominated by the fixed
cost of each node and by how well a kernel splits a small matrix over the threads. Measured on a real 135M
Llama (SmolLM2-135M, 30 layers, INT4) with 2 threads: 211 fully connected nodes a step become 121 and the step
takes 0.90x the time (bench/cpu_kernels/fc_kernels.py and docs/results/2026-12-one-node.md).

Only weights stored alike are fused: the same chain of decompression ops from the stored constant to the
MatMul (element types, a group layout [rows, groups, group_size], scales and zero points of one row each), so
the stacked constants decompress with the very chain each one had. A weight that the INT8 budget kept INT8
beside INT4 neighbours stays on its own. The OpenVINO CPU plugin fuses q/k/v and gate/up itself only on AMX
with bf16 or f16 compute and f16/bf16/INT8 weights (its QKVProjFusion and MLPFusion), never for INT4 weights.

Not fused: a mixture of experts' stacked expert weights (rank 3: the plugin's GatherMatmul conversion needs
them as they are) and a router (it stays f32 and alone; compress_weights.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult
from ovshard.passes.compress_weights import router_ops

_CHAIN_OPS = ("Convert", "Reshape", "Multiply", "Subtract")  # a weight's decompression, from its stored constant


@dataclass(frozen=True)
class Step:
    """One op of a weight's decompression chain: ``side`` is the constant operand of a Multiply (a scale) or
    Subtract (a zero point), itself a Constant or a Convert of one; a Reshape's target shape is rebuilt."""

    node: ov.Node
    side: ov.Node | None = None  # the side operand's stored Constant
    side_convert: ov.Type | None = None  # the element type a side Convert turns it into


@dataclass(frozen=True)
class Weight:
    """A MatMul that reads ``source`` times a constant weight [rows, ...] through ``steps``."""

    matmul: ov.Node
    stored: ov.Node  # the Constant
    steps: tuple[Step, ...]  # stored -> ... -> the MatMul's weight input

    @property
    def rows(self) -> int:
        return int(self.stored.get_output_shape(0)[0])

    def signature(self) -> tuple:
        """What must be equal for two weights to stack: every op, element type and per-row shape of the chain."""
        sig: list = [self.matmul.input_value(0).get_element_type().get_type_name(), _per_row(self.stored)]
        for step in self.steps:
            node = step.node
            sig.append((node.get_type_name(), node.get_output_element_type(0).get_type_name(),
                        tuple(node.get_output_partial_shape(0).to_shape()[1:])))
            if step.side is not None:
                sig.append((_per_row(step.side), step.side_convert and step.side_convert.get_type_name()))
        return tuple(sig)


def _per_row(const: ov.Node) -> tuple:
    return const.get_output_element_type(0).get_type_name(), tuple(const.get_output_shape(0)[1:])


def _side(node: ov.Node) -> tuple[ov.Node, ov.Type | None] | None:
    """A Multiply's or Subtract's constant operand: (stored Constant, the type a Convert gives it or None)."""
    if node.get_type_name() == "Constant":
        return node, None
    if node.get_type_name() == "Convert" and node.input_value(0).get_node().get_type_name() == "Constant":
        return node.input_value(0).get_node(), node.get_output_element_type(0)
    return None


def weight_of(matmul: ov.Node) -> Weight | None:
    """The MatMul's weight chain when it is x @ W^T with W [rows, cols] built from one stored constant whose
    every constant has one entry per row (so stacking rows stacks every constant); else None."""
    attrs = matmul.get_attributes()
    if attrs["transpose_a"] or not attrs["transpose_b"] or matmul.get_input_partial_shape(1).rank.get_length() != 2:
        return None
    steps: list[Step] = []
    node = matmul.input_value(1).get_node()
    while node.get_type_name() != "Constant":
        if node.get_type_name() not in _CHAIN_OPS or any(v.get_target_inputs() and len(v.get_target_inputs()) > 1
                                                         for v in node.outputs()):
            return None  # not a decompression chain, or one another op reads midway
        side = None
        if node.get_type_name() in ("Multiply", "Subtract"):
            side = _side(node.input_value(1).get_node())
            if side is None:
                return None
        elif node.get_type_name() == "Reshape" and node.input_value(1).get_node().get_type_name() != "Constant":
            return None
        steps.append(Step(node, *(side or (None, None))))
        node = node.input_value(0).get_node()
    if len(node.output(0).get_target_inputs()) > 1:
        return None
    weight = Weight(matmul, node, tuple(reversed(steps)))
    rows = weight.rows
    sides = [s.side for s in weight.steps if s.side is not None]
    if any(not side.get_output_shape(0) or side.get_output_shape(0)[0] != rows for side in sides):
        return None  # a scale or zero point shared by all rows: nothing to stack by row
    if any(s.node.get_type_name() == "Reshape" and s.node.get_output_shape(0)[0] != rows for s in weight.steps):
        return None
    return weight


def _stacked(consts: list[ov.Node], name: str) -> ov.Node:
    """One Constant holding ``consts`` one after another along axis 0 (their bytes, so packed 4-bit rows stack)."""
    first = consts[0]
    shape = [sum(int(c.get_output_shape(0)[0]) for c in consts), *first.get_output_shape(0)[1:]]
    tensor = ov.Tensor(first.get_output_element_type(0), ov.Shape(shape))
    raw = np.concatenate([np.ascontiguousarray(c.get_data()).reshape(-1).view(np.uint8) for c in consts])
    tensor.data.reshape(-1).view(np.uint8)[:] = raw
    stacked = ov.op.Constant(tensor, shared_memory=False)
    stacked.set_friendly_name(name)
    return stacked


def _fused_name(members: list[Weight]) -> str:
    """``self.layers.0.q_weight`` + ``...k_weight`` -> ``self.layers.0.q_weight+k_weight``."""
    first = members[0].stored.get_friendly_name()
    prefix = first.rsplit(".", 1)[0] + "." if "." in first else ""
    rest = [m.stored.get_friendly_name() for m in members[1:]]
    return first + "".join("+" + (n[len(prefix):] if n.startswith(prefix) else n) for n in rest)


def fuse(members: list[Weight]) -> ov.Node:
    """Replace ``members`` (MatMuls of one input, weights of one signature) by one MatMul and a VariadicSplit
    along the last axis; returns the split."""
    rows, name = [m.rows for m in members], _fused_name(members)
    x = members[0].matmul.input_value(0)
    w: ov.Output = _stacked([m.stored for m in members], name).output(0)
    for i, step in enumerate(members[0].steps):
        kind = step.node.get_type_name()
        if kind == "Convert":
            w = ops.convert(w, step.node.get_output_element_type(0)).output(0)
        elif kind == "Reshape":
            w = ops.reshape(w, ops.constant(np.array([sum(rows), *step.node.get_output_shape(0)[1:]], np.int64)),
                            False).output(0)
        else:
            side: ov.Output = _stacked([m.steps[i].side for m in members], f"{name}/{kind}").output(0)
            if step.side_convert is not None:
                side = ops.convert(side, step.side_convert).output(0)
            w = (ops.multiply(w, side) if kind == "Multiply" else ops.subtract(w, side)).output(0)
    product = ops.matmul(x, w, False, True, name=f"{name}/MatMul")  # [..., sum of rows]
    split = ops.variadic_split(product, ops.constant(np.int64(-1)), ops.constant(np.array(rows, np.int64)))
    for n, member in enumerate(members):
        member.matmul.output(0).replace(split.output(n))
    return split


def fusable_groups(model: ov.Model) -> list[list[Weight]]:
    """MatMuls that read the same output with weights of one signature, two or more a group, each group ordered
    by its weights' names (graph order is not: a layer traced alone or beside others may list v before q, and a
    piece's bytes must not depend on the stage boundaries; ovshard.cache)."""
    routers = set(router_ops(model))
    groups: dict[tuple, list[Weight]] = defaultdict(list)
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or op.get_friendly_name() in routers:
            continue
        weight = weight_of(op)
        if weight is None:
            continue
        source = op.input_value(0)
        if source.get_node().get_type_name() == "Constant":
            continue
        key = (source.get_node().get_instance_id(), source.get_index(), weight.signature())
        groups[key].append(weight)
    return [sorted(members, key=lambda w: w.stored.get_friendly_name()) for members in groups.values()
            if len(members) > 1]


class FuseProjectionsPass(GraphPass):
    """Stack the weights of MatMuls that share an input into one MatMul, split after (q/k/v, gate/up)."""

    scope = "layer"  # a layer's projections live in its piece

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        if "CompressWeightsPass" not in ctx.history:
            raise self.unmet(ctx, "weights are fused as stored: run CompressWeightsPass first (it chooses a format "
                                  "for each projection on its own)")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        groups = fusable_groups(model)
        for members in groups:
            fuse(members)
        if groups:
            model.validate_nodes_and_infer_types()
        return PassResult(model, modified=bool(groups))

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        left = fusable_groups(model)
        if left:
            raise self.fail(ctx, f"{len(left)} groups of MatMuls still share an input and a weight format, e.g. "
                                 f"{[m.matmul.get_friendly_name() for m in left[0]]}")
