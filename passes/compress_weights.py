"""CompressWeightsPass: weight compression of the stage's MatMul and embedding weights.

Formats: ``fp32`` (nothing changes), ``fp16`` (weights stored as f16 with a decompression Convert),
``int8`` (NNCF INT8_ASYM, per channel), ``int4_sym`` / ``int4_asym`` (NNCF, grouped).

Default ``int4_asym``, group size 128, ratio 1.0, all_layers False. Why: asymmetric INT4 keeps more
accuracy than symmetric at the same size on Llama weights (it is also optimum-intel's default for
``--weight-format int4``); 128 is the group size both OpenVINO's CPU and GPU kernels are tuned for;
ratio 1.0 because a ratio < 1 only pays off with a calibration dataset; all_layers False keeps the
embedding and the last MatMul of each stage (the lm_head in the last stage) in INT8, where INT4 error
hurts most. Channels not divisible by the group size get the largest power-of-two group that divides
them, or INT8 when none does (NNCF's ADJUST fallback).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import replace

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.bundle import names
from ovshard.bundle.weights import WeightFormat
from ovshard.ir.pass_manager import GraphPass, PassContext, PassResult

log = logging.getLogger(__name__)

_COMPRESSED_TYPES = {ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8, ov.Type.f16, ov.Type.bf16}
_MIN_WEIGHT_ELEMENTS = 1024  # smaller constants (norms, shapes, tables) are never compressed


def float_weights(model: ov.Model) -> list[ov.Node]:
    """Float constants of weight size that feed a MatMul or Gather directly: still uncompressed."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() not in ("MatMul", "Gather"):
            continue
        src = op.input_value(0 if op.get_type_name() == "Gather" else 1).get_node()
        if (src.get_type_name() == "Constant" and src.get_output_element_type(0) == ov.Type.f32
                and int(np.prod(src.get_output_shape(0))) >= _MIN_WEIGHT_ELEMENTS
                and src.get_friendly_name() != names.ROTARY_TABLE):
            found.append(src)
    return found


def _to_fp16(model: ov.Model, weights: list[ov.Node]) -> None:
    for const in weights:
        half = ops.constant(const.get_data().astype(np.float16))
        decompress = ops.convert(half, ov.Type.f32)
        const.output(0).replace(decompress.output(0))


class CompressWeightsPass(GraphPass):
    """Compress weights to the chosen format (NNCF for the integer formats)."""

    scope = "layer"  # each weight is compressed on its own: a streamed compile runs this piece by piece

    def __init__(self, fmt: WeightFormat | None = None) -> None:
        self.fmt = fmt or WeightFormat()

    def format_for(self, ctx: PassContext) -> WeightFormat:
        """The format NNCF applies here. NNCF keeps a graph's embeddings and its last MatMul in the backup
        precision (INT8) unless all_layers; on a piece of a stage that rule must mean the stage's embedding
        and last MatMul, so a piece holding neither is compressed as with all_layers."""
        piece = ctx.piece
        if piece is None or piece.kind == "embedding" or piece.holds_last_matmul:
            return self.fmt
        return replace(self.fmt, all_layers=True)

    def call(self, model: ov.Model, ctx: PassContext) -> PassResult:
        weights = float_weights(model)
        if self.fmt.mode == "fp32" or not weights:
            return PassResult(model, modified=False)
        if self.fmt.mode == "fp16":
            _to_fp16(model, weights)
        else:
            self._nncf(model, ctx)
        model.validate_nodes_and_infer_types()
        return PassResult(model, modified=True)

    def _nncf(self, model: ov.Model, ctx: PassContext) -> None:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        logging.getLogger("nncf").setLevel(logging.WARNING)
        fmt = self.format_for(ctx)
        mode = {"int8": nncf.CompressWeightsMode.INT8_ASYM, "int4_sym": nncf.CompressWeightsMode.INT4_SYM,
                "int4_asym": nncf.CompressWeightsMode.INT4_ASYM}[fmt.mode]
        kwargs: dict = {"mode": mode}
        if fmt.mode != "int8":  # NNCF's INT8 modes are per channel and always cover every layer
            kwargs.update(group_size=fmt.group_size, ratio=fmt.ratio, all_layers=fmt.all_layers,
                          advanced_parameters=AdvancedCompressionParameters(
                              group_size_fallback_mode=GroupSizeFallbackMode.ADJUST))
        where = f"stage {ctx.stage.index}" + (f" {ctx.piece}" if ctx.piece is not None else "")
        log.log(logging.DEBUG if ctx.piece is not None else logging.INFO, "%s: NNCF %s on %d weights", where,
                fmt.mode, len(float_weights(model)))
        with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars: stdout carries results only
            nncf.compress_weights(model, **kwargs)

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        if self.fmt.mode == "fp32":
            return
        left = [c.get_friendly_name() for c in float_weights(model)]
        if left:
            raise self.fail(ctx, f"{len(left)} weights are still f32 after {self.fmt.mode} compression: {left[:3]}")
