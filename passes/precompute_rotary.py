"""PrecomputeRotaryPass: the rotary frequency math becomes a Gather from a constant cos/sin table.

Before: position_ids -> Convert -> Multiply(inv_freq) -> Concat -> Cos/Sin -> Multiply(scaling) -> ...
After:  Gather(Constant table [max_positions, head_dim], position_ids, axis 0) for each rotary value.

The pass finds the subgraph that depends on ``position_ids`` and constants only, takes its outputs
that the rest of the graph reads (the "frontier") when they come from Cos/Sin math, evaluates them
once for positions 0..max_positions-1 on the CPU plugin, and replaces each by a table lookup. The
table is exactly what the graph computed, so the rewrite changes no numbers. Position-only ops that
compute the same value are merged first, so a stage joined from pieces gets one table per value, not
one per layer.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.bundle import names
from ovshard.ir import graph
from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult

_TRIG = ("Cos", "Sin")


def _position_only(model: ov.Model, position_ids: ov.Node) -> set[int]:
    """Instance ids of nodes computed from position_ids and constants alone."""
    pos = {position_ids.get_instance_id()}
    for op in model.get_ordered_ops():
        sources = [v.get_node() for v in op.input_values()]
        if not sources or op.get_type_name() in ("Parameter", "Constant", "ReadValue"):
            continue
        if all(s.get_instance_id() in pos or s.get_type_name() == "Constant" for s in sources) and any(
            s.get_instance_id() in pos for s in sources
        ):
            pos.add(op.get_instance_id())
    return pos


def _has_trig_upstream(node: ov.Node, pos: set[int]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n.get_type_name() in _TRIG:
            return True
        for v in n.input_values():
            src = v.get_node()
            if src.get_instance_id() in pos and src.get_instance_id() not in seen:
                seen.add(src.get_instance_id())
                stack.append(src)
    return False


def _signature(op: ov.Node, canonical: dict[int, ov.Output]) -> tuple:
    """What an op computes: type, attributes, inputs (after merging); a Constant by its bytes."""
    if op.get_type_name() == "Constant":
        return ("Constant", str(op.get_output_element_type(0)), tuple(op.get_output_shape(0)), op.get_data().tobytes())
    inputs = []
    for v in op.input_values():
        v = canonical.get(v.get_node().get_instance_id(), v) if v.get_node().get_output_size() == 1 else v
        inputs.append((v.get_node().get_instance_id(), v.get_index()))
    return (op.get_type_name(), repr(sorted(op.get_attributes().items())), tuple(inputs))


def merge_duplicate_math(model: ov.Model, position_ids: ov.Node) -> int:
    """Merge position-only ops that compute the same value (and their small constants); return how many.

    A stage joined from pieces repeats each layer's rotary reshapes (``cos[:, None]``); merged, they
    become one frontier value and one table instead of one per layer.
    """
    pos = _position_only(model, position_ids)
    seen: dict[tuple, ov.Output] = {}
    canonical: dict[int, ov.Output] = {}
    merged = 0
    for op in model.get_ordered_ops():
        small = op.get_type_name() == "Constant" and op.get_byte_size() <= 64 and all(
            r.get_node().get_instance_id() in pos for r in op.output(0).get_target_inputs())
        if op.get_output_size() != 1 or not (small or op.get_instance_id() in pos) or op is position_ids:
            continue
        key = _signature(op, canonical)
        if key in seen:
            canonical[op.get_instance_id()] = seen[key]
            op.output(0).replace(seen[key])
            merged += 1
        else:
            seen[key] = op.output(0)
    return merged


def rotary_frontier(model: ov.Model, position_ids: ov.Node) -> list[ov.Output]:
    """Outputs of rotary math (position-only, with Cos/Sin upstream) that other nodes consume."""
    pos = _position_only(model, position_ids)
    frontier = []
    for op in model.get_ordered_ops():
        if op.get_instance_id() not in pos or op is position_ids:
            continue
        for out in op.outputs():
            readers = [t.get_node() for t in out.get_target_inputs()]
            if any(r.get_instance_id() not in pos for r in readers) and _has_trig_upstream(op, pos):
                frontier.append(out)
    return frontier


def _evaluate(outputs: list[ov.Output], position_ids: ov.Node, positions: np.ndarray) -> list[np.ndarray]:
    sub = ov.Model(outputs, [position_ids]).clone()
    compiled = ov.Core().compile_model(sub, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    values = compiled({0: positions})
    return [values[compiled.output(i)] for i in range(len(outputs))]


def _sequence_axis(table_shape, probe_shape, max_positions: int, probe_ids_shape) -> int | None:
    """The axis that runs over positions: max_positions long in the table, seq long in the probe."""
    batch, seq = probe_ids_shape
    if len(table_shape) != len(probe_shape) or table_shape[0] != 1 or probe_shape[0] != batch:
        return None
    axes = [a for a in range(1, len(table_shape)) if table_shape[a] == max_positions and probe_shape[a] == seq]
    return axes[0] if len(axes) == 1 else None


def _restore_order(ndim: int, seq_axis: int) -> list[int]:
    """Permutation from a gathered [batch, seq, ...rest] back to the layout with seq at ``seq_axis``."""
    order = [0] + list(range(2, ndim))  # batch and rest, in gathered positions
    order.insert(seq_axis, 1)
    return order


class PrecomputeRotaryPass(GraphPass):
    """Replace the rotary frequency math by Gather(position_ids) from constant tables."""

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        if graph.parameter(model, names.POSITION_IDS) is None:
            raise self.unmet(ctx, f"the graph has no {names.POSITION_IDS!r} input to index a rotary table by")
        if ctx.max_positions < 1:
            raise self.unmet(ctx, f"max_positions must be >= 1, got {ctx.max_positions}")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        position_ids = graph.parameter(model, names.POSITION_IDS)
        merged = merge_duplicate_math(model, position_ids)
        frontier = rotary_frontier(model, position_ids)
        if not frontier:
            return PassResult(model, modified=merged > 0)
        table_positions = np.arange(ctx.max_positions, dtype=np.int64)[None, :]  # [1, max_positions]
        tables = _evaluate(frontier, position_ids, table_positions)
        probe = np.array([[3, 0, 1], [1, 2, 0]], dtype=np.int64) % ctx.max_positions  # [batch 2, seq 3]
        probed = _evaluate(frontier, position_ids, probe)
        for out, table, check in zip(frontier, tables, probed, strict=True):
            seq_axis = _sequence_axis(table.shape, check.shape, ctx.max_positions, probe.shape)
            if seq_axis is None:
                raise self.error(ctx, f"rotary value {out} evaluates to shape {table.shape} for positions "
                                f"[1, {ctx.max_positions}]; expected batch first and one axis per position")
            rows = np.ascontiguousarray(np.moveaxis(table[0], seq_axis - 1, 0))  # [max_positions, ...rest]
            perm = _restore_order(table.ndim, seq_axis)  # [batch, seq, ...rest] -> original layout
            if not np.allclose(np.take(rows, probe, axis=0).transpose(perm), check, rtol=1e-6, atol=1e-6):
                raise self.error(ctx, f"rotary value {out} is not a per-position function of position_ids")
            lookup = ops.gather(ops.constant(rows, name=names.ROTARY_TABLE), position_ids, ops.constant(np.int64(0)))
            if perm != list(range(table.ndim)):
                lookup = ops.transpose(lookup, ops.constant(np.array(perm, np.int64)))
            graph.redirect(out, lookup.output(0))
        merge_duplicate_math(model, position_ids)  # the lookups' own axis constants: a second run finds nothing
        model.validate_nodes_and_infer_types()
        return PassResult(model, modified=True)

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        position_ids = graph.parameter(model, names.POSITION_IDS)
        if rotary_frontier(model, position_ids):
            raise self.fail(ctx, "rotary Cos/Sin math is still computed from position_ids")
