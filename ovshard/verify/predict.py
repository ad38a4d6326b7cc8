"""Predict, from the IR alone, whether the CPU and GPU plugins will fuse each layer's KV cache.

A static mirror of two plugin rewrites, evaluated per stage and per KV layer (a key/value variable
pair), with no device needed. Each condition becomes a :class:`Check` whose detail says what was
found, what the plugin expects, and what to do. ``ovshard.verify.fusion`` is the runtime counterpart (CPU).

Confirmed against openvinotoolkit/openvino sources (read, not copied):

CPU, ``StatefulSDPAFusion`` in
src/plugins/intel_cpu/src/transformations/cpu_opset/common/pass/stateful_sdpa_fusion.cpp
(commits 02c2d1938704 and dca5caea134e; a later 2025 revision in ov::pass::pattern form adds the
equal-axes check):
  - pattern: ReadValue -> [Convert] -> Gather v8 (batch_dims 0; indices any ``i32 [?]`` value, axis
    any) -> Concat(gathered, new) -> [GQA chain: Unsqueeze -> Broadcast v3 bidirectional -> Reshape,
    or Reshape|Unsqueeze -> Multiply(ones) -> Reshape] -> [Transpose] -> ScaledDotProductAttention
    v13, K at input 1 and V at input 2;
  - every reader of the ReadValue is an SDPA, ShapeOf, Convert or Gather; every optional node above
    has one consumer; the Gather has one consumer (the Concat), counted after SDPASubgraphFusion's
    SimplifyGatherShapeOf has moved any ShapeOf of the Gather onto the Gather's inputs;
  - the Concat has 2 consumers, or 3 of which one is a ShapeOf; one of them is the Assign of the
    same variable, directly or through a one-consumer Convert;
  - K and V are gathered by the same indices output; K and V Concats share one axis.
  Measured here (OpenVINO 2026.4.1): a ReadValue without an initializer fails compile_model; a
  type-changing Convert between ReadValue and Gather (an f16/bf16 state) does not fuse, even though
  the pattern admits one Convert (likely because the CPU pipeline runs ConvertPrecision before
  SDPASubgraphFusion and rewrites that chain); a Convert that keeps the type is harmless.

GPU, ``KVCacheFusion`` in src/plugins/intel_gpu/src/plugin/transformations/kv_cache_fusion.cpp
(commit 03315bf6bad0): ReadValue -> [Convert] -> [Gather(past, Parameter, Constant)] ->
Concat(past, new) -> [Convert] -> Assign of the same variable, and the Concat's element type equals
the ReadValue's ("TODO: Support conversion internally"). No initializer is required.
GPU, ``IndirectKVCache`` in .../transformations/indirect_kv_cache.cpp (commits 0251123e7840,
16f3e8489461): Gather v8 whose data input is the ReadValue itself (nothing between), indices a
Parameter, axis a one-value Constant 0 or 1, feeding the KVCache; IndirectSDPAOpt needs K and V
gathered by the same beam_idx node; IndirectGemmOpt does the same for a Gemm (MatMul attention).
transformations_pipeline.cpp (commit 35a9c292b3db) keeps SDPA only for f16 output, rank 4, equal
static head sizes in 64..256 and a multiple of 16 (any head size <= 256 on XMX GPUs with oneDNN
micro-kernels); otherwise SDPA is decomposed and IndirectGemm carries the beam table instead.

Not mirrored: the transpose-order equality of Q/K/V, the ones-constant of the Multiply GQA form,
and the plugins' own transformation callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import openvino as ov

from ovshard.bundle import names
from ovshard.ir import graph
from ovshard.ir.pass_manager import Instrument, PassContext
from ovshard.verify.kv_trace import KVVar, pair_variables, readers, trace_variable

if TYPE_CHECKING:
    from ovshard.bundle.manifest import Manifest

log = logging.getLogger(__name__)

HAS_STATE = "stage holds KV state"
BEAM_INPUT = "beam_idx is a model input"
INITIALIZER = "ReadValue has an initializer"
GATHERED = "Gather(beam_idx) on the ReadValue"
GATHER_DIRECT = "Gather directly on ReadValue"
STATE_TYPE = "state type equals the KV compute type"
BEAM_I32 = "beam_idx is i32 [?]"
BEAM_PARAM = "beam_idx is a Parameter"
GATHER_AXIS = "Gather axis is a Constant 0 or 1"
SAME_BEAM = "K and V gathered by the same beam_idx"
GATHER_TO_CONCAT = "Gather feeds the Concat directly"
CONCAT_TO_ASSIGN = "Concat feeds the Assign of the same variable"
SDPA = "attention is ScaledDotProductAttention"
ATTENTION = "attention reads the KV Concat"

RECOMPILE = "recompile with ovshard"
_GQA = {("Unsqueeze", "Broadcast", "Reshape"), ("Unsqueeze", "Multiply", "Reshape"),
        ("Reshape", "Multiply", "Reshape")}
_CPU_CHAINS = {(), ("Transpose",)} | _GQA | {c + ("Transpose",) for c in _GQA}


@dataclass(frozen=True)
class Check:
    """One condition for one KV layer (or the stage) on one device."""

    device: str  # "CPU" or "GPU"
    subject: str  # "layer 3 (past_key_values.3.key/value)" or "stage"
    condition: str  # short name, one of the constants above
    holds: bool
    detail: str  # found vs expected, and what to do


@dataclass(frozen=True)
class Prediction:
    stage: int
    device: str
    layers: int  # KV layers found (pairs of variables)
    checks: tuple[Check, ...]

    @property
    def fused_layers(self) -> int:
        """Layers whose every check holds."""
        subjects = {c.subject for c in self.checks if c.subject != "stage"}
        return sum(all(c.holds for c in self.checks if c.subject == s) for s in subjects)

    @property
    def ok(self) -> bool:
        return self.layers > 0 and all(c.holds for c in self.checks)


# ---- per-variable conditions: (holds, what was found), or None where not applicable ------------------------

Finding = tuple[bool, str] | None
_Table = Sequence[tuple[str, Callable[[KVVar], Finding], str]]  # condition, test, what to do


def _type(out: ov.Output) -> str:
    return out.get_element_type().get_type_name()


def _initializer(kv: KVVar) -> Finding:
    present = kv.read.get_input_size() == 1
    return present, "initializer present" if present else "no initializer"


def _state_type(kv: KVVar) -> Finding:
    if kv.concat is None:
        return None
    state, compute = _type(kv.read.output(0)), _type(kv.concat.output(0))
    return state == compute, f"state {state}, Concat {compute}"


def _cpu_gathered(kv: KVVar) -> Finding:
    if kv.gather is None:
        reader = f" (by {kv.concat.get_friendly_name()})" if kv.concat is not None else ""
        return False, f"read without a Gather{reader}"
    if kv.others:
        return False, f"ReadValue also read by {', '.join(kv.others)}"
    return kv.gather.get_attributes().get("batch_dims", 0) == 0, f"Gather {kv.gather.get_friendly_name()}"


def _cpu_beam_i32(kv: KVVar) -> Finding:
    if kv.gather is None:
        return None
    out = kv.gather.input_value(1)
    rank = out.get_partial_shape().rank
    return (out.get_element_type() == ov.Type.i32 and rank.is_static and rank.get_length() == 1,
            f"indices {out.get_node().get_friendly_name()!r} {_type(out)} {out.get_partial_shape()}")


def _cpu_to_concat(kv: KVVar) -> Finding:
    if kv.gather is None:
        return None
    # SDPASubgraphFusion runs SimplifyGatherShapeOf first: a ShapeOf of the Gather moves to its inputs
    found = [t.get_node() for t in readers(kv.gather.output(0)) if t.get_node().get_type_name() != "ShapeOf"]
    concat = kv.concat
    source = concat.input_value(0).get_node() if concat is not None else None
    first = source is not None and source.get_instance_id() == kv.gather.get_instance_id()
    direct = len(found) == 1 and first and concat is not None and concat.get_input_size() == 2
    return direct, "Gather -> " + ", ".join(n.get_type_name() for n in found)


def _cpu_assign(kv: KVVar) -> Finding:
    if kv.concat is None:
        return None
    found = [t.get_node().get_type_name() for t in readers(kv.concat.output(0))]
    count_ok = len(found) == 2 or (len(found) == 3 and "ShapeOf" in found)
    target = graph.variable_id(kv.assign) if kv.assign is not None else None
    return count_ok and target == kv.vid, f"Concat -> {', '.join(sorted(found))}; Assign of {target}"


def _gpu_direct(kv: KVVar) -> Finding:
    if kv.gather is None:
        return False, "no Gather: KVCache forms but has no beam table"
    if kv.convert is not None:
        convert = f"Convert({_type(kv.convert.input_value(0))}->{_type(kv.convert.output(0))})"
        return False, f"ReadValue -> {convert} -> Gather"
    return True, f"ReadValue -> Gather {kv.gather.get_friendly_name()}"


def _gpu_beam_param(kv: KVVar) -> Finding:
    if kv.gather is None:
        return None
    beam = kv.gather.input_value(1).get_node()
    return beam.get_type_name() == "Parameter", f"indices {beam.get_type_name()} {beam.get_friendly_name()!r}"


def _gpu_axis(kv: KVVar) -> Finding:
    if kv.gather is None:
        return None
    node = kv.gather.input_value(2).get_node()
    value = node.get_data().reshape(-1).tolist() if node.get_type_name() == "Constant" else None
    return value is not None and len(value) == 1 and value[0] in (0, 1), f"axis {value or node.get_type_name()}"


def _gpu_chain(kv: KVVar) -> Finding:
    if kv.concat is None:
        return False, "no Concat reads the state"
    source = next(n for n in (kv.gather, kv.convert, kv.read) if n is not None)
    first = kv.concat.input_value(0).get_node().get_instance_id() == source.get_instance_id()
    target = graph.variable_id(kv.assign) if kv.assign is not None else None
    return (kv.concat.get_input_size() == 2 and first and target == kv.vid,
            f"state is Concat input {0 if first else 'other than 0'} of {kv.concat.get_input_size()}, "
            f"Assign of {target}")


_CPU_VARIABLE: _Table = [
    (INITIALIZER, _initializer,
     f"without one compile_model fails on CPU; {RECOMPILE} (MakeStatefulKVPass adds a zero initializer)"),
    (GATHERED, _cpu_gathered,
     f"expected ReadValue -> Gather(beam_idx) only; {RECOMPILE} (InjectBeamIdxGatherPass)"),
    (STATE_TYPE, _state_type, "a Convert that changes type between ReadValue and Gather stops the fusion; keep "
     "the KV variables in the model's compute type (ovshard's f32 state)"),
    (BEAM_I32, _cpu_beam_i32, f"the CPU pattern needs i32 rank-1 indices; make {names.BEAM_IDX!r} i32 [batch] "
     f"({RECOMPILE})"),
    (GATHER_TO_CONCAT, _cpu_to_concat, "the Gather must have one reader, input 0 of a two-input Concat"),
    (CONCAT_TO_ASSIGN, _cpu_assign,
     "the Concat needs 2 readers (3 if one is a ShapeOf), one the Assign of its variable"),
]
_GPU_VARIABLE: _Table = [
    (CONCAT_TO_ASSIGN, _gpu_chain,
     "KVCacheFusion needs ReadValue -> [Gather] -> Concat(past, new) -> [Convert] -> Assign"),
    (STATE_TYPE, _state_type,
     "KVCacheFusion does not convert internally; keep the KV variables in the compute type"),
    (GATHER_DIRECT, _gpu_direct,
     f"IndirectKVCache needs Gather(ReadValue, beam_idx) with nothing between; {RECOMPILE} "
     "(InjectBeamIdxGatherPass)"),
    (BEAM_PARAM, _gpu_beam_param,
     f"IndirectKVCache needs the indices to be a Parameter; feed {names.BEAM_IDX!r} directly"),
    (GATHER_AXIS, _gpu_axis, "use Gather axis 0 (batch) as a one-value Constant"),
]


def _variable_checks(device: str, subject: str, pair: list[KVVar], table: _Table) -> list[Check]:
    """One Check per condition over both variables of a layer; a failing detail names the failing variable."""
    checks = []
    for condition, test, fix in table:
        results = [(kv, found) for kv in pair if (found := test(kv)) is not None]
        if results:
            holds = all(found[0] for _, found in results)
            text = "; ".join(f"{kv.vid}: {found[1]}" for kv, found in results if holds or not found[0])
            checks.append(Check(device, subject, condition, holds, text if holds else f"{text}. {fix}"))
    return checks


def _same_beam(device: str, subject: str, pair: list[KVVar]) -> list[Check]:
    gathers = [kv.gather for kv in pair if kv.gather is not None]
    if len(pair) != 2 or len(gathers) != 2:
        return []
    k, v = (g.input_value(1) for g in gathers)
    same = k.get_node().get_instance_id() == v.get_node().get_instance_id() and k.get_index() == v.get_index()
    found = f"K by {k.get_node().get_friendly_name()!r}, V by {v.get_node().get_friendly_name()!r}"
    fix = f"gather both by the one {names.BEAM_IDX!r} input; {RECOMPILE} (InjectBeamIdxGatherPass uses one)"
    return [Check(device, subject, SAME_BEAM, same, found if same else f"{found}. {fix}")]


def _cpu_sdpa_problem(kv: KVVar, port: int) -> str | None:
    att, chain = kv.attention, tuple(n.get_type_name() for n in kv.chain)
    if att is None or att.get_node().get_type_name() != "ScaledDotProductAttention":
        kind = "no attention op" if att is None else att.get_node().get_type_name()
        return f"{kv.vid} reaches {kind}, not ScaledDotProductAttention"
    if chain not in _CPU_CHAINS or att.get_index() != port:
        return f"{kv.vid} reaches SDPA input {att.get_index()} through {' -> '.join(chain) or 'nothing'}"
    if any(len(n.output(0).get_target_inputs()) != 1 for n in kv.chain):
        return f"{kv.vid}: a node between Concat and SDPA has other readers"
    modes = [n.get_attributes().get("mode") for n in kv.chain if n.get_type_name() == "Broadcast"]
    if any(mode != "bidirectional" for mode in modes):
        return f"{kv.vid}: the GQA Broadcast is not bidirectional"
    return None


def _cpu_attention(subject: str, pair: list[KVVar]) -> list[Check]:
    concats = [kv.concat for kv in pair if kv.concat is not None]
    if len(concats) != len(pair):
        return []
    problems = [p for kv, port in zip(pair, (1, 2), strict=False) if (p := _cpu_sdpa_problem(kv, port))]
    sdpas = {kv.attention.get_node().get_instance_id() for kv in pair if kv.attention is not None}
    if not problems and len(sdpas) > 1:
        problems.append("K and V feed different SDPA nodes")
    if not problems and len({c.get_attributes()["axis"] for c in concats}) > 1:
        problems.append("K and V Concats use different axes")
    found = "; ".join(" -> ".join([kv.vid] + [n.get_type_name() for n in kv.chain] + ["SDPA"]) for kv in pair)
    fix = "StatefulSDPAFusion matches only SDPA; trace F.scaled_dot_product_attention (ovshard's tracer does)"
    return [Check("CPU", subject, SDPA, not problems, f"{'; '.join(problems)}. {fix}" if problems else found)]


def _gpu_attention(subject: str, pair: list[KVVar]) -> list[Check]:
    if any(kv.concat is None for kv in pair):
        return []
    attention = [kv.attention for kv in pair if kv.attention is not None]
    if len(attention) != len(pair):
        missing = ", ".join(kv.vid for kv in pair if kv.attention is None)
        return [Check("GPU", subject, ATTENTION, False, f"{missing}: no SDPA/MatMul reads the Concat through "
                      "reshapes only, so no kernel reads the beam table")]
    node = attention[0].get_node()
    if node.get_type_name() == "MatMul":
        return [Check("GPU", subject, ATTENTION, True, "MatMul attention: IndirectGemm reads the beam table")]
    query = node.get_input_partial_shape(0)
    head = query[query.rank.get_length() - 1] if query.rank.is_static else None
    size = head.get_length() if head is not None and head.is_static else None
    if size is not None and 64 <= size <= 256 and size % 16 == 0:
        return [Check("GPU", subject, ATTENTION, True, f"SDPA head size {size}: kept in f16, IndirectSDPA")]
    return [Check("GPU", subject, ATTENTION, True,
                  f"SDPA head size {size}: outside 64..256 step 16, so except on XMX GPUs with micro-kernels "
                  "(<= 256) it is decomposed and IndirectGemm reads the beam table")]


_DEVICES = {"CPU": (_CPU_VARIABLE, _cpu_attention), "GPU": (_GPU_VARIABLE, _gpu_attention)}


def _stage_checks(model: ov.Model, device: str, layers: int) -> list[Check]:
    beam = graph.parameter(model, names.BEAM_IDX)
    found = f"{_type(beam.output(0))} {beam.get_output_partial_shape(0)}" if beam is not None else ""
    return [
        Check(device, "stage", HAS_STATE, layers > 0, f"KV layers: {layers}" if layers else
              f"no ReadValue: the stage is stateless; {RECOMPILE} (MakeStatefulKVPass)"),
        Check(device, "stage", BEAM_INPUT, beam is not None,
              f"{names.BEAM_IDX}: {found}" if beam is not None
              else f"no {names.BEAM_IDX!r} input; {RECOMPILE} (InjectBeamIdxGatherPass adds it)"),
    ]


# ---- public API --------------------------------------------------------------------------------------------


def predict_model(model: ov.Model, device: str, stage: int = 0) -> Prediction:
    """Mirror the device's KV-cache fusion conditions on ``model``, per layer ("GPU.1" counts as GPU)."""
    kind = device.split(".")[0].upper()
    if kind not in _DEVICES:
        raise ValueError(f"no fusion predictor for device {device!r}; expected one of {sorted(_DEVICES)}")
    table, attention = _DEVICES[kind]
    groups = pair_variables([trace_variable(read) for read in graph.ops_of_type(model, "ReadValue")])
    checks = _stage_checks(model, kind, len(groups))
    for subject, pair in groups:
        checks += _variable_checks(kind, subject, pair, table) + _same_beam(kind, subject, pair)
        checks += attention(subject, pair)
    return Prediction(stage, kind, len(groups), tuple(checks))


def predict_bundle(bundle: Path, manifest: Manifest, devices: Sequence[str]) -> list[Prediction]:
    """One Prediction per stage and device, read from each stage's IR (nothing is compiled)."""
    core = ov.Core()
    predictions = []
    for entry in manifest.stages:
        model = core.read_model(str(Path(bundle) / entry.model_xml))
        predictions += [predict_model(model, device, entry.index) for device in devices]
    return predictions


def format_predictions(preds: Sequence[Prediction], failures_only: bool = False) -> str:
    """A table (stage, device, subject, condition, verdict, detail), then one summary line per prediction."""
    rows = [("stage", "device", "subject", "condition", "verdict", "detail")]
    for p in preds:
        rows += [(str(p.stage), p.device, c.subject, c.condition, "ok" if c.holds else "FAIL", c.detail)
                 for c in p.checks if not (failures_only and c.holds)]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, [*widths, 0], strict=True)).rstrip()
             for row in rows]
    summary = [f"stage {p.stage} {p.device}: {p.fused_layers}/{p.layers} layers predicted fused"
               + ("" if p.ok else " (see FAIL rows)") for p in preds]
    return "\n".join(lines + [""] + summary)


class PredictFusionInstrument(Instrument):
    """After the pipeline: log whether each device's plugin will fuse the KV cache, and warn what blocks it."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)

    def run_end(self, model: ov.Model, ctx: PassContext) -> None:
        index = ctx.stage.index
        if ctx.dims.attention_softcap is not None or ctx.dims.attention_sinks:
            why = ("attention sinks" if ctx.dims.attention_sinks
                   else f"attn_logit_softcapping={ctx.dims.attention_softcap}")
            log.info("stage %d: attention is explicit by design (%s has no SDPA form), so no plugin fuses the KV "
                     "cache into it; the cache is still stateful", index, why)
            return
        for device in self.devices:
            prediction = predict_model(model, device, index)
            log.info("stage %d: %s KV-cache fusion predicted for %d/%d layers", index, device,
                     prediction.fused_layers, prediction.layers)
            for check in prediction.checks:
                if not check.holds:
                    log.warning("stage %d: %s fusion will not fire for %s: %s (%s)", index, device,
                                check.subject, check.condition, check.detail)
