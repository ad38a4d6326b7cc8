"""MakeStatefulKVPass: past/present KV inputs and outputs become ReadValue/Assign state.

Each layer's ``past_key_values.{i}.key`` Parameter is replaced by a ReadValue of a variable of the
same name, and the matching ``present.{i}.key`` Result by an Assign to that variable. Every ReadValue
gets an initializer, zeros broadcast to [batch, kv_heads, 0, head_dim], so the first inference (or the
first after ``reset_state``) starts from an empty cache; the CPU plugin refuses to compile a
ReadValue without one, and openvino-genai reads the KV axes from the initializer's shape.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op.util import Variable, VariableInfo

from ovshard.bundle import names
from ovshard.ir import graph
from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult


def kv_pairs(ctx: PassContext) -> list[tuple[str, str]]:
    """(past input, present output) names of the stage's layers, keys then values per layer."""
    return names.kv_pairs(ctx.stage.layers)


def _empty_cache(model: ov.Model, ctx: PassContext, dim: int) -> ov.Node:
    """zeros [batch, kv_heads, 0, dim], batch taken from the stage's primary input (dim: the key's or the value's
    head width, ``ModelDims.cache_dims``)."""
    primary = graph.parameter(model, names.INPUT_IDS if ctx.stage.first else names.HIDDEN_STATES)
    batch = ops.gather(ops.shape_of(primary), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0)))
    rest = ops.constant(np.array([ctx.dims.cache_heads, 0, dim], np.int64))
    shape = ops.concat([batch, rest], axis=0)  # [batch, kv_heads, 0, head_dim]
    return ops.broadcast(ops.constant(np.float32(0)), shape)


class MakeStatefulKVPass(GraphPass):
    """Turn KV-cache I/O pairs into ReadValue (with a zero initializer) and Assign."""

    def requires(self, model: ov.Model, ctx: PassContext) -> None:
        present = [graph.parameter(model, past) is not None for past, _ in kv_pairs(ctx)]
        stateful = {graph.variable_id(rv) for rv in graph.ops_of_type(model, "ReadValue")}
        if any(present) and not all(present):
            missing = [p for (p, _), ok in zip(kv_pairs(ctx), present, strict=False) if not ok]
            raise self.unmet(ctx, f"some KV inputs are missing: {missing}; expected all of layers "
                            f"[{ctx.stage.start}, {ctx.stage.end}) or none")
        if not any(present) and stateful != {past for past, _ in kv_pairs(ctx)}:
            raise self.unmet(ctx, "the graph has neither past_key_values inputs nor the KV variables of layers "
                            f"[{ctx.stage.start}, {ctx.stage.end}); was it traced with a KV cache?")

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        if graph.parameter(model, kv_pairs(ctx)[0][0]) is None:
            return PassResult(model, modified=False)
        for n, (past_name, present_name) in enumerate(kv_pairs(ctx)):
            past = graph.parameter(model, past_name)
            present = graph.result(model, present_name)
            if past is None or present is None:
                raise self.unmet(ctx, f"input {past_name!r} has no matching output {present_name!r}")
            info = VariableInfo()
            info.data_shape = past.get_output_partial_shape(0)  # [batch, kv_heads, seq, head_dim]
            info.data_type = past.get_output_element_type(0)
            info.variable_id = past_name
            variable = Variable(info)
            read = ops.read_value(_empty_cache(model, ctx, ctx.dims.cache_dims[n % 2]), variable, name=past_name)
            graph.redirect(past.output(0), read.output(0))
            value = present.input_value(0)
            if value.get_index() != 0:  # the Assign binding takes a node and reads its first output
                value = ops.convert(value, value.get_element_type()).output(0)
            assign = ops.assign(value.get_node(), variable, name=present_name)
            model.remove_result(present)
            model.remove_parameter(past)
            model.add_variables([variable])
            model.add_sinks([assign])
        model.validate_nodes_and_infer_types()
        return PassResult(model, modified=True)

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        reads = {graph.variable_id(rv): rv for rv in graph.ops_of_type(model, "ReadValue")}
        assigns = {graph.variable_id(a) for a in model.get_sinks() if a.get_type_name() == "Assign"}
        for past_name, _ in kv_pairs(ctx):
            if past_name not in reads or past_name not in assigns:
                raise self.fail(ctx, f"variable {past_name!r} lacks its ReadValue or Assign")
            if reads[past_name].get_input_size() != 1:
                raise self.fail(ctx, f"ReadValue {past_name!r} has no initializer; the CPU plugin needs one")
