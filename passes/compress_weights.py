"""CompressWeightsPass: weight compression of the stage's MatMul and embedding weights.

Formats: ``fp32`` (nothing changes), ``fp16`` (weights stored as f16 with a decompression Convert),
``int8`` (NNCF INT8_ASYM, per channel), ``int4_sym`` / ``int4_asym`` (NNCF, grouped), ``int4_affine`` (grouped
min-max with an f16 zero point, written here in NNCF's asymmetric form: :func:`int4_affine_weight`).

Which weights keep the backup precision (INT8_ASYM, per channel) is decided for the whole model, never
per stage: the embedding and the lm_head, unless ``all_layers``, and the decoder weights the format
names in ``int8_weights`` (chosen by ``ovshard.plan.precision`` before any stage is built). NNCF's own rule ("the embeddings and
the last MatMul of the graph") applied to each stage's graph would keep a different MatMul in INT8 for
every stage count (the last down_proj of every stage but the last), so the same checkpoint compiled into
1, 2 or 4 stages would get different weights and different tokens. So every decoder weight goes through
NNCF with ``all_layers=True`` and the backup weights through INT8_ASYM, in a streamed compile by the
piece's kind (``embedding``, ``head``, ``layers``), in a whole-stage compile by the graph (the Gather
weights and the MatMuls that feed the logits). Channels not divisible by the group size get the largest
power-of-two group that divides them, or INT8 when none does (NNCF's ADJUST fallback).

A mixture of experts' stacked expert weights ([experts, out, in]) are compressed like any MatMul weight:
NNCF groups each expert's rows on its own, and the CPU plugin's GatherMatmul reads them compressed. The
router ([experts, hidden], a fraction of a percent of a layer) and a shared expert's one-output gate stay f32
in every format, as llama.cpp keeps its ``ffn_gate_inp``: its top-k is a discrete choice that a quantization
error near a tie would flip.

The default format and why it was chosen: ``ovshard.bundle.weights``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ovshard.bundle import names
from ovshard.bundle.weights import OWN_FIT, WeightFormat
from ovshard.errors import PassError
from ovshard.ir.pass_manager import Calibration, GraphPass, PassContext, PassResult

log = logging.getLogger(__name__)

_COMPRESSED_TYPES = {ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8, ov.Type.f16, ov.Type.bf16}
_MIN_WEIGHT_ELEMENTS = 1024  # smaller constants (norms, shapes, tables) are never compressed
# NNCF's scale estimation: 2 rounds of its importance-weighted scale fit and none of its grid search (1.0 down to
# 0.95, 0.90, ... of the scale). Measured on SmolLM2-135M (bench/int4_frontier.py, 16 samples of the shipped text):
# NNCF's defaults (5 and 5) +4.1% perplexity over fp32, 2 and 0 +2.0% (1 and 0 +3.4%, 5 and 0 +2.0%, 0 and 2 +2.4%),
# and each round is a quantization of every weight: 2 and 0 costs a third of the defaults.
SCALE_ESTIMATION_ROUNDS = 2
SCALE_ESTIMATION_GRID_STEPS = 0


_ROUTER_WEIGHT = re.compile(r"layers\.\d+\.(shared_)?router_weight$")


def router_ops(model: ov.Model) -> list[str]:
    """Names of the MatMuls that read a mixture of experts' router weight, which stays f32."""
    return [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
            and _ROUTER_WEIGHT.search(op.input_value(1).get_node().get_friendly_name())]


def float_weights(model: ov.Model) -> list[ov.Node]:
    """Float constants of weight size that feed a MatMul or Gather directly: still uncompressed (routers,
    kept f32 on purpose, not counted)."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() not in ("MatMul", "Gather"):
            continue
        src = op.input_value(0 if op.get_type_name() == "Gather" else 1).get_node()
        if (src.get_type_name() == "Constant" and src.get_output_element_type(0) == ov.Type.f32
                and int(np.prod(src.get_output_shape(0))) >= _MIN_WEIGHT_ELEMENTS
                and src.get_friendly_name() != names.ROTARY_TABLE
                and not _ROUTER_WEIGHT.search(src.get_friendly_name())):
            found.append(src)
    return found


def weight_ops(model: ov.Model) -> list[ov.Node]:
    """The MatMul and Gather ops that read a still-uncompressed weight (``float_weights``)."""
    weights = {w.get_friendly_name() for w in float_weights(model)}
    return [op for op in model.get_ordered_ops() if op.get_type_name() in ("MatMul", "Gather")
            and op.input_value(0 if op.get_type_name() == "Gather" else 1).get_node().get_friendly_name() in weights]


_DECODER_WEIGHT = re.compile(
    r"layers\.(\d+)\.(q|k|v|o|q_a|q_b|kv_a|kv_b|gate|up|down|experts_gate|experts_up|experts_down|experts_gate_up"
    r"|shared_gate|shared_up|shared_down)_weight$")  # q_a, q_b, kv_a, kv_b: latent attention's projections


def backup_ops(model: ov.Model, ctx: PassContext, fmt: WeightFormat) -> set[str]:
    """Names of the ops whose weights stay INT8: the model's embedding and lm_head (unless ``all_layers``),
    wherever they are, and the decoder weights ``fmt.int8_weights`` names."""
    ops_here = weight_ops(model)
    piece = ctx.piece
    backup = set()
    if not fmt.all_layers:
        backup = _ends(model, ctx, ops_here)
    if fmt.int8_weights and (piece is None or piece.kind == "layers"):
        first = piece.start if piece is not None and piece.start is not None else ctx.stage.start
        here = range(first, piece.end if piece is not None and piece.end is not None else ctx.stage.end)
        wanted = {k for k in fmt.int8_weights if int(k.split(".")[0]) in here}
        found = set()
        for op in ops_here:
            match = _DECODER_WEIGHT.search(op.input_value(1).get_node().get_friendly_name())
            if op.get_type_name() == "MatMul" and match:
                key = f"{first + int(match[1])}.{match[2]}"
                if key in wanted:
                    backup.add(op.get_friendly_name())
                    found.add(key)
        if found != wanted:
            raise PassError(f"stage {ctx.stage.index}: the INT8 weights {sorted(wanted - found)} have no MatMul "
                            "named after them in this graph (this front end names weights otherwise); compile "
                            "with --budget 1.0 or the torchscript front end")
    return backup


def _ends(model: ov.Model, ctx: PassContext, ops_here: list[ov.Node]) -> set[str]:
    """The embedding and the lm_head: by the piece in a streamed compile, by the graph in a whole-stage one."""
    if ctx.piece is not None:
        return {op.get_friendly_name() for op in ops_here} if ctx.piece.kind in ("embedding", "head") else set()
    backup = {op.get_friendly_name() for op in ops_here if op.get_type_name() == "Gather"}
    logits = [r for r in model.get_results() if r.get_output_size() and names.LOGITS in
              r.input_value(0).get_names()]
    stack, seen = [r.input_value(0) for r in logits], set()
    while stack:  # up from the logits along vocabulary-wide values (soft-capping, row chunks) to the lm_head
        value = stack.pop()
        node = value.get_node()
        last = value.get_partial_shape()[-1] if value.get_partial_shape().rank.is_static else None
        if id(node) in seen or last is None or last.is_dynamic or last.get_length() != ctx.dims.vocab_size:
            continue
        seen.add(id(node))
        if node.get_type_name() == "MatMul":
            backup.add(node.get_friendly_name())
        else:
            stack += list(node.input_values())
    return backup & {op.get_friendly_name() for op in ops_here}


def _ignored(ops_names: list[str]) -> object:
    import nncf

    return nncf.IgnoredScope(names=sorted(ops_names)) if ops_names else None


def int4_weight(name: str, codes: np.ndarray, scales: np.ndarray, shape: tuple[int, ...]) -> ov.Node:
    """A symmetric INT4 weight in the form NNCF writes it, which the CPU plugin fuses into its compressed
    FullyConnected: i4 codes [out, groups, group] -> Convert f16 -> Multiply by the f16 scales [out, groups, 1]
    -> Reshape to [out, in] -> Convert f32."""
    nibbles = (codes.view(np.uint8) & 0x0F).reshape(-1, 2)  # two codes a byte, the first in the low nibble
    stored = ov.op.Constant(ov.Tensor(nibbles[:, 0] | (nibbles[:, 1] << 4), list(codes.shape), ov.Type.i4),
                            shared_memory=False)  # packed here: OpenVINO's own packing of int8 codes is slow
    stored.set_friendly_name(name)
    scale = ops.constant(scales, dtype=ov.Type.f16, name=f"{name}/scale")
    weight = ops.multiply(ops.convert(stored, ov.Type.f16), scale, name=f"{name}/fq_weights_1")
    weight = ops.reshape(weight, ops.constant(np.array(shape, np.int64)), special_zero=False)
    return ops.convert(weight, ov.Type.f32, name=f"{name}/fq_weights_1/convert")


def int4_asym_weight(name: str, codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
                     shape: tuple[int, ...]) -> ov.Node:
    """An asymmetric INT4 weight in NNCF's form: u4 codes and u4 zero points -> Convert f16 -> Subtract -> Multiply
    by the f16 scales -> Reshape -> Convert f32."""

    def u4(values: np.ndarray, label: str) -> ov.Node:
        flat = values.reshape(-1).astype(np.uint8) & 0x0F
        flat = np.concatenate([flat, np.zeros(len(flat) % 2, np.uint8)]).reshape(-1, 2)
        const = ov.op.Constant(ov.Tensor(flat[:, 0] | (flat[:, 1] << 4), list(values.shape), ov.Type.u4),
                               shared_memory=False)
        const.set_friendly_name(label)
        return const

    stored = u4(codes, name)
    zero = ops.convert(u4(zeros, f"{name}/zero_point"), ov.Type.f16)
    scale = ops.constant(scales, dtype=ov.Type.f16, name=f"{name}/scale")
    weight = ops.multiply(ops.subtract(ops.convert(stored, ov.Type.f16), zero), scale, name=f"{name}/fq_weights_1")
    weight = ops.reshape(weight, ops.constant(np.array(shape, np.int64)), special_zero=False)
    return ops.convert(weight, ov.Type.f32, name=f"{name}/fq_weights_1/convert")


def int4_affine_weight(name: str, w: np.ndarray, shape: tuple[int, ...]) -> ov.Node:
    """``w`` [out, groups, group] as min-max INT4 with an f16 zero point: the scale ``(max - min) / 15`` and the zero
    point ``-min / scale`` of each group, both f16 as stored (llama.cpp's Q4_1 keeps the minimum itself); codes
    in [0, 15]. The CPU plugin fuses it as it does NNCF's u4 zero points (an f32 one per group at run time)."""
    low = w.min(axis=-1, keepdims=True)
    scale = ((w.max(axis=-1, keepdims=True) - low) / 15.0).astype(np.float16)
    scale[np.abs(scale) < np.finfo(np.float16).tiny] = np.finfo(np.float16).tiny  # a constant group
    s = scale.astype(np.float32)
    zero = (-low / s).astype(np.float16)
    codes = np.clip(np.round(w / s + zero.astype(np.float32)), 0, 15).astype(np.uint8).reshape(-1)
    codes = np.concatenate([codes, np.zeros(len(codes) % 2, np.uint8)]).reshape(-1, 2)
    stored = ov.op.Constant(ov.Tensor(codes[:, 0] | (codes[:, 1] << 4), list(w.shape), ov.Type.u4), shared_memory=False)
    stored.set_friendly_name(name)
    offset = ops.constant(zero, dtype=ov.Type.f16, name=f"{name}/zero_point")
    weight = ops.multiply(ops.subtract(ops.convert(stored, ov.Type.f16), offset),
                          ops.constant(scale, dtype=ov.Type.f16, name=f"{name}/scale"), name=f"{name}/fq_weights_1")
    weight = ops.reshape(weight, ops.constant(np.array(shape, np.int64)), special_zero=False)
    return ops.convert(weight, ov.Type.f32, name=f"{name}/fq_weights_1/convert")


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

        logging.getLogger("nncf").setLevel(logging.WARNING)
        ops_here = weight_ops(model)
        tables = _ends(model, ctx, ops_here) if self._table_format() is not None else set()
        backup = (set() if self.fmt.mode == "int8" else backup_ops(model, ctx, self.fmt)) - tables
        rest = [op.get_friendly_name() for op in ops_here if op.get_friendly_name() not in backup | tables]
        routers = router_ops(model)
        where = f"stage {ctx.stage.index}" + (f" {ctx.piece}" if ctx.piece is not None else "")
        log.log(logging.DEBUG if ctx.piece is not None else logging.INFO, "%s: NNCF %s on %d weights, %d in INT8",
                where, self.fmt.mode, len(rest) + len(backup) + len(tables), len(backup))
        with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars: stdout carries results only
            if tables:
                self._tables(model, ctx, tables, [*backup, *rest, *routers])
                backup |= tables  # compressed already: every later NNCF call leaves them alone
            if backup - tables:
                nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM,
                                      ignored_scope=_ignored([*rest, *routers, *tables]))
            if rest and self.fmt.mode == "int4_affine":
                written = self._affine(model, set(rest))
                backup |= written
                rest = [name for name in rest if name not in written]
                if rest:  # no INT4 group fits them: INT8, as NNCF's ADJUST fallback stores them
                    nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM,
                                          ignored_scope=_ignored([*backup, *routers]))
                    rest = []
            if rest and OWN_FIT in self.fmt.methods:
                fitted = self._fit(model, ctx, set(rest), where)
                rest = [name for name in rest if name not in fitted]
                backup |= fitted  # NNCF leaves them alone: they are INT4 already
            if rest:
                data_aware = self._data_aware(ctx, where)
                nncf.compress_weights(model, **self._nncf_args(), **data_aware,
                                      ignored_scope=_ignored([*backup, *routers]))
                if data_aware:  # NNCF's statistics and graphs are cyclic garbage: free them before the next layer
                    del data_aware
                    gc.collect()

    def _table_format(self) -> WeightFormat | None:
        """The embedding's and lm_head's own INT4 format: ``WeightFormat.table`` (``--embedding``), or the decoder's
        own where ``all_layers`` asks for ovshard's fit (a fit works on the layers' inputs, which a table's piece
        has not: the tables are fitted to the lm_head's inputs as ``--embedding`` fits them); None: NNCF's."""
        if self.fmt.table is not None:
            return self.fmt.table
        return self.fmt if self.fmt.all_layers and OWN_FIT in self.fmt.methods else None

    def _tables(self, model: ov.Model, ctx: PassContext, tables: set[str], others: list[str]) -> None:
        """The embedding and lm_head in their INT4 format (``_table_format``): in a calibrated streamed compile
        fitted to the lm_head's inputs (``Calibration.fit_table``), else NNCF's data-free INT4."""
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        table = self._table_format()
        assert table is not None
        if OWN_FIT in self.fmt.methods and ctx.calibration is not None:
            free = [] if ctx.dims.tie_word_embeddings else [  # an untied embedding never feeds the lm_head
                op.get_friendly_name() for op in weight_ops(model)
                if op.get_type_name() == "Gather" and op.get_friendly_name() in tables]
            for op in (op for op in weight_ops(model) if op.get_friendly_name() in tables - set(free)):
                gather = op.get_type_name() == "Gather"
                const = op.input_value(0 if gather else 1).get_node()
                shape = tuple(const.get_output_shape(0))
                group = table.group_for(shape[-1])
                if group is None or len(shape) != 2 or not (gather or op.get_attributes()["transpose_b"]):
                    raise PassError(f"{ctx.where(self.name)}: the table {op.get_friendly_name()} ({shape}) is not a "
                                    "[rows, hidden] Gather or lm_head this fit knows; compile with --embedding int8")
                name = const.get_friendly_name()
                fitted = ctx.calibration.fit_table(const.get_data(), group, asym=table.mode == "int4_asym")
                if len(fitted) == 3:
                    stored = int4_asym_weight(name, fitted[0], fitted[1], fitted[2], shape)
                else:
                    stored = int4_weight(name, fitted[0], fitted[1], shape)
                const.output(0).replace(stored.output(0))
            if not free:
                return
            others, tables = [*others, *(tables - set(free))], set(free)
        mode = {"int4_sym": nncf.CompressWeightsMode.INT4_SYM, "int4_asym": nncf.CompressWeightsMode.INT4_ASYM}
        nncf.compress_weights(model, mode=mode[table.mode], group_size=table.group_size, ratio=1.0, all_layers=True,
                              ignored_scope=_ignored(others), advanced_parameters=AdvancedCompressionParameters(
                                  group_size_fallback_mode=GroupSizeFallbackMode.ADJUST))

    def _affine(self, model: ov.Model, ops_wanted: set[str]) -> set[str]:
        """``int4_affine`` groups (:func:`int4_affine_weight`) for the [out, in] MatMul weights (and, with
        ``all_layers``, Gather tables) among ``ops_wanted`` that an INT4 group fits; returns the ops done."""
        done = set()
        for op in weight_ops(model):
            gather = op.get_type_name() == "Gather"
            const = op.input_value(0 if gather else 1).get_node()
            shape = tuple(const.get_output_shape(0))
            group = self.fmt.group_for(shape[-1])
            if (op.get_friendly_name() not in ops_wanted or group is None or len(shape) != 2
                    or not (gather or op.get_attributes()["transpose_b"])):
                continue
            w = const.get_data().astype(np.float32).reshape(shape[0], -1, group)
            const.output(0).replace(int4_affine_weight(const.get_friendly_name(), w, shape).output(0))
            done.add(op.get_friendly_name())
        return done

    def _fit(self, model: ov.Model, ctx: PassContext, ops_wanted: set[str], where: str) -> set[str]:
        """Symmetric INT4 of the decoder weights among ``ops_wanted`` fitted to their calibration inputs
        (``Calibration.fit_int4``), written as NNCF writes INT4 (:func:`int4_weight`); returns the ops done. A
        weight no INT4 group fits, or not of the [out, in] form (or experts' [experts, out, in]), is left to NNCF
        (data-free)."""
        calibration = self._calibration(ctx, where)
        assert ctx.piece is not None and ctx.piece.start is not None
        done = set()
        for op in weight_ops(model):
            const = op.input_value(1).get_node()
            match = _DECODER_WEIGHT.search(const.get_friendly_name())
            shape = tuple(const.get_output_shape(0))
            stacked = len(shape) == 3 and match is not None and match[2].startswith("experts_")  # [experts, out, in]
            if (op.get_friendly_name() not in ops_wanted or op.get_type_name() != "MatMul" or match is None
                    or not (len(shape) == 2 or stacked) or not op.get_attributes()["transpose_b"]):
                continue
            group = self.fmt.group_for(shape[-1])
            if group is None:
                continue
            try:
                codes, scales = calibration.fit_int4(f"{ctx.piece.start + int(match[1])}.{match[2]}",
                                                     const.get_data(), group)
            except PassError as e:
                raise PassError(f"{ctx.where(self.name)}: {e}") from e
            const.output(0).replace(int4_weight(const.get_friendly_name(), codes, scales, shape).output(0))
            done.add(op.get_friendly_name())
        log.debug("%s: %d INT4 weights fitted to the calibration inputs", where, len(done))
        return done

    def _calibration(self, ctx: PassContext, where: str) -> Calibration:
        if ctx.calibration is None or ctx.piece is None or ctx.piece.kind != "layers":
            raise PassError(f"{where}: --calibration-methods {','.join(self.fmt.methods)} need calibration inputs "
                            "and this compile has none (a whole-stage or parallel compile); compile streamed, "
                            "one job, or with --calibration none")
        return ctx.calibration

    def _data_aware(self, ctx: PassContext, where: str) -> dict:
        """NNCF's data-aware arguments for a layer piece of a calibrated compile: the piece's calibration inputs
        (the float32 layers' activations, ``ovshard.frontend.calibration``) and the chosen methods."""
        import nncf

        nncf_methods = [m for m in self.fmt.methods if m != OWN_FIT]
        if not nncf_methods or ctx.piece is None or ctx.piece.kind != "layers":
            return {}
        items = self._calibration(ctx, where)(ctx.piece)
        if not items:
            raise PassError(f"{where}: --calibration-methods {','.join(self.fmt.methods)} need calibration inputs "
                            "and this compile has none (a whole-stage or parallel compile); compile streamed, "
                            "one job, or with --calibration none")
        log.info("%s: NNCF %s with %d calibration samples", where, "+".join(self.fmt.methods), len(items))
        return {"dataset": nncf.Dataset(items), "subset_size": len(items), **{method: True for method in nncf_methods}}

    def _scale_estimation(self) -> dict:
        """``AdvancedCompressionParameters`` arguments for NNCF's scale estimation, where the format asks for it."""
        from nncf.quantization.advanced_parameters import AdvancedScaleEstimationParameters

        if "scale_estimation" not in self.fmt.methods:
            return {}
        return {"scale_estimation_params": AdvancedScaleEstimationParameters(
            initial_steps=SCALE_ESTIMATION_ROUNDS, scale_steps=SCALE_ESTIMATION_GRID_STEPS)}

    def _nncf_args(self) -> dict:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        mode = {"int8": nncf.CompressWeightsMode.INT8_ASYM, "int4_sym": nncf.CompressWeightsMode.INT4_SYM,
                "int4_asym": nncf.CompressWeightsMode.INT4_ASYM}[self.fmt.mode]
        if self.fmt.mode == "int8":  # NNCF's INT8 modes are per channel and always cover every layer
            return {"mode": mode}
        return {"mode": mode, "group_size": self.fmt.group_size, "ratio": 1.0, "all_layers": True,
                "advanced_parameters": AdvancedCompressionParameters(
                    group_size_fallback_mode=GroupSizeFallbackMode.ADJUST, **self._scale_estimation())}

    def ensures(self, model: ov.Model, ctx: PassContext) -> None:
        if self.fmt.mode == "fp32":
            return
        left = [c.get_friendly_name() for c in float_weights(model)]
        if left:
            raise self.fail(ctx, f"{len(left)} weights are still f32 after {self.fmt.mode} compression: {left[:3]}")
