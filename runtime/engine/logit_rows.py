"""Logits only for the rows a step needs: a transformation the runtime applies when it loads a last stage.

A last stage computes ``logits [1, T, vocab]`` for every fed position, while the head reads the last row
when decoding and K+1 rows when verifying drafts: an 8,000-token prompt on a 128K vocabulary would make a
4 GB tensor to read one row of it. On loading, the worker slices the lm_head's input to its last ``n``
rows, ``n`` a new input (``names.LOGIT_ROWS``, i64 [1]) it sets per step from the Step's ``want`` (``protocol.rows_read``). The
bundle on disk is unchanged (an ordinary stateful OpenVINO LLM that openvino-genai loads; genai does the
same slicing of its own). Every op between the lm_head and the logits (Gemma 2's soft-capping) is row by
row, and so are the final norm before it: the last rows are what the whole tensor's last rows were.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.bundle import names
from ovshard.errors import BundleError

_ROW_WISE = ("Multiply", "Divide", "Tanh", "Add", "Subtract", "Convert")  # soft-capping, decompression


def lm_head(model: ov.Model, vocab: int) -> ov.Node:
    """The MatMul that makes the logits: up from the ``logits`` result through row-wise ops."""
    result = next((r for r in model.get_results() if names.LOGITS in r.input_value(0).get_names()), None)
    if result is None:
        raise BundleError(f"the last stage has no {names.LOGITS!r} output")
    node = result.input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        if node.get_type_name() not in _ROW_WISE:
            raise BundleError(f"cannot find the lm_head above the logits: met {node.get_type_name()} "
                              f"{node.get_friendly_name()!r}")
        node = next(v.get_node() for v in node.input_values()
                    if v.get_partial_shape().rank.is_static and v.get_partial_shape()[-1].is_static
                    and v.get_partial_shape()[-1].get_length() == vocab and v.get_node().get_type_name() != "Constant")
    return node


def slice_logit_rows(model: ov.Model, vocab: int) -> ov.Model:
    """``model`` with the lm_head fed only the last ``logit_rows`` rows of its input (a new i64 [1] input)."""
    head = lm_head(model, vocab)
    hidden = head.input_value(0)  # [batch, T, hidden]
    rows = ops.parameter(ov.PartialShape([1]), ov.Type.i64, name=names.LOGIT_ROWS)
    rows.output(0).get_tensor().set_names({names.LOGIT_ROWS})
    start = ops.negative(rows)
    stop = ops.constant(np.array([np.iinfo(np.int64).max], np.int64))
    last = ops.slice(hidden, start, stop, ops.constant(np.array([1], np.int64)), ops.constant(np.array([1], np.int64)))
    head.input(0).replace_source_output(last.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
    return model
