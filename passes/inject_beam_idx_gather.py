"""InjectBeamIdxGatherPass: a ``beam_idx`` i32 Parameter and Gather(axis 0) on every KV ReadValue.

This is the pattern OpenVINO's plugins fuse the KV cache into attention from: StatefulSDPAFusion
on CPU (needs beam_idx i32 and the Gather feeding the Concat directly) and KVCacheFusion +
IndirectKVCache on Intel GPUs (needs the Gather directly on the ReadValue, a Parameter for indices,
and a one-value constant axis). Without it the cache is read and rewritten every step.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.bundle import names
from ovshard.ir import graph
from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult


def is_beam_gather(node: ov.Node, beam_idx: ov.Node) -> bool:
    """True for Gather(x, beam_idx, axis=0)."""
    if node.get_type_name() != "Gather":
        return False
    indices, axis = node.input_value(1).get_node(), node.input_value(2).get_node()
    return (
        indices.get_instance_id() == beam_idx.get_instance_id()
        and axis.get_type_name() == "Constant"
        and axis.get_data().size == 1
        and int(axis.get_data().reshape(-1)[0]) == 0
    )


def gathered(read: ov.Node, beam_idx: ov.Node | None) -> bool:
    """True if every reader of the ReadValue is a beam_idx Gather."""
    readers = graph.consumers(read)
    return beam_idx is not None and bool(readers) and all(is_beam_gather(r, beam_idx) for r in readers)


class InjectBeamIdxGatherPass(GraphPass):
    """Add ``beam_idx`` (i32 [batch]) and reorder every KV ReadValue by it along the batch axis."""

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        if not graph.ops_of_type(model, "ReadValue"):
            raise self.unmet(ctx, "the graph has no ReadValue to gather; run MakeStatefulKVPass first")
        beam_idx = graph.parameter(model, names.BEAM_IDX)
        if beam_idx is not None and beam_idx.get_output_element_type(0) != ov.Type.i32:
            raise self.unmet(ctx, f"beam_idx is {beam_idx.get_output_element_type(0)}, expected i32 "
                            "(the CPU fusion requires i32)")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        beam_idx = graph.parameter(model, names.BEAM_IDX)
        reads = [r for r in graph.ops_of_type(model, "ReadValue") if not gathered(r, beam_idx)]
        if not reads:
            return PassResult(model, modified=False)
        if beam_idx is None:
            beam_idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name=names.BEAM_IDX)  # [batch]
            beam_idx.output(0).get_tensor().set_names({names.BEAM_IDX})
            model.add_parameters([beam_idx])
        axis = ops.constant(np.int64(0))
        for read in reads:
            gather = ops.gather(read, beam_idx, axis, name=f"{graph.variable_id(read)}.beam_gather")
            graph.redirect(read.output(0), gather.output(0), keep=[gather])
        model.validate_nodes_and_infer_types()
        return PassResult(model, modified=True)

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        beam_idx = graph.parameter(model, names.BEAM_IDX)
        for read in graph.ops_of_type(model, "ReadValue"):
            if not gathered(read, beam_idx):
                raise self.fail(ctx, f"ReadValue {graph.variable_id(read)!r} is read without the beam_idx Gather")
