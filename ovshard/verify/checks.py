"""``ovshard verify``: prove from compiled graphs that every fusion fired, and check the numbers.

Three kinds of check, each a row of (stage, check, expected, found, verdict):
- runtime: compile each stage on the device and read ``get_runtime_model()``: one KV-fused
  ScaledDotProductAttention per layer, no attention MatMul/Softmax, weights stored in the precision
  the manifest names;
- static (``--predict``): the predictor in ``ovshard.verify.predict`` reads the IR only and mirrors the
  plugins' fusion preconditions, so a GPU fusion can be checked on a machine without a GPU;
- numerical (``--reference``): the bundle against the Hugging Face model on the same prompt.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import openvino as ov

from ovshard.bundle.manifest import Manifest, read_manifest, verify_files
from ovshard.errors import ConfigError
from ovshard.verify.fusion import explicit_attention_layers, moe_layers, runtime_fusion
from ovshard.verify.rows import Row


@dataclass(frozen=True)
class VerifyConfig:
    bundle: Path
    device: str | None = "CPU"  # compile and inspect on this device; None: no runtime check
    predict: tuple[str, ...] = ()  # devices for the static predictor
    reference: Path | None = None  # Hugging Face checkpoint for the numerical check
    prompt: str = "Once upon a time"
    tokens: int = 32
    perplexity: Path | None = None  # a text scored by the bundle and the reference (needs reference)
    perplexity_context: int | None = None  # its chunk length; None: 512, or the bundle's positions when fewer


# Weight storage the CPU plugin shows on FullyConnected inputs, by manifest weight mode.
# int4_affine: i4 codes once SplitZeroPointsPass moved the f16 zero points out (u4 where it was skipped)
_WEIGHT_TYPES = {"int4_asym": {"u4", "u8"}, "int4_affine": {"i4", "u4", "u8"}, "int4_sym": {"i4", "i8", "u8"}, "int8": {"u8", "i8"}}


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


_FLOAT = {"f32", "bf16", "f16"}


def weight_precisions(runtime: ov.Model) -> Counter:
    """Element types of the constant weights feeding each FullyConnected node of a runtime graph.

    A float weight the plugin folded from a decompression chain (its original layers are the stored
    constant's Convert/Subtract/Multiply, not one f32 constant) is counted as ``"<type> from compressed"``:
    the bundle stores it compressed and the CPU plugin unpacks it at load, as it does for small INT8
    matrices whose input width its compressed kernels do not take (stories260K's 172-wide down_proj).
    A mixture of experts' router, f32 on purpose (``CompressWeightsPass``), is counted as ``"f32 router"``:
    a FullyConnected whose scores go to a TopK (directly or through its softmax) or, a shared expert's gate,
    whose output is one wide. The MatMul of group sums that ``SplitZeroPointsPass`` adds for f16 zero points
    (its input a ReduceSum, its weights folded from the stored zero points and scales) is counted as
    ``"f32 zero points"``.
    """
    found: Counter = Counter()
    for op in runtime.get_ordered_ops():
        if op.get_rt_info()["layerType"].astype(str) != "FullyConnected":
            continue
        weight = op.input_value(1).get_node()
        precision = weight.get_rt_info()["outputPrecisions"].astype(str)
        folded = "," in weight.get_rt_info()["originalLayersNames"].astype(str)
        if precision == "f32" and _is_router(op):
            found["f32 router"] += 1
            continue
        if precision == "f32" and _layer_type(_producer(op)) == "Reduce":
            found["f32 zero points"] += 1  # SplitZeroPointsPass's MatMul of group sums, folded from f16 z and s
            continue
        found[f"{precision} from compressed" if precision in _FLOAT and folded else precision] += 1
    return found


def _layer_type(node: ov.Node) -> str:
    return str(node.get_rt_info()["layerType"].astype(str))


def _producer(op: ov.Node) -> ov.Node:
    """The node that computes ``op``'s first input, past the plugin's precision Reorders."""
    node = op.input_value(0).get_node()
    while _layer_type(node) == "Reorder":
        node = node.input_value(0).get_node()
    return node


def _is_router(op: ov.Node) -> bool:
    """A FullyConnected of a MoE router (its scores reach a TopK through at most a Softmax and Reorders) or a
    shared expert's gate."""
    shape = op.get_output_partial_shape(0)
    if shape.rank.is_static and shape[shape.rank.get_length() - 1] == 1:
        return True
    nodes = [t.get_node() for t in op.output(0).get_target_inputs()]
    for _ in range(3):  # through a Softmax and the plugin's precision Reorders
        nodes += [t.get_node() for n in nodes if _layer_type(n) in ("Softmax", "Reorder")
                  for t in n.output(0).get_target_inputs()]
    return any(_layer_type(n) == "TopK" for n in nodes)


def runtime_rows(bundle: Path, m: Manifest, device: str, core: ov.Core) -> list[Row]:
    if device not in core.available_devices:
        return [Row(None, f"runtime graph on {device}", f"an OpenVINO {device} device",
                    f"none here (devices: {', '.join(core.available_devices)})", "skip")]
    if device == "GPU":
        return gpu_runtime_rows(bundle, m, core)
    rows = []
    for entry in m.stages:
        compiled = core.compile_model(str(bundle / entry.model_xml), device)
        layers = entry.layers[1] - entry.layers[0]
        fusion = runtime_fusion(compiled, entry.index, layers, explicit_attention_layers(m, layers),
                                moe_layers(m, entry.layers), m.architecture.expert_projections)
        rows.append(Row(entry.index, "KV-fused SDPA (beam_idx + 2 MemoryInput)", str(fusion.expected_fused),
                        str(fusion.fused_sdpa), _verdict(fusion.fused_sdpa == fusion.expected_fused)))
        if fusion.moe_layers:
            rows.append(Row(entry.index, "experts as GatherMatmul (reading only the routed experts)",
                            str(fusion.expected_gather_matmuls), str(fusion.gather_matmuls),
                            _verdict(fusion.experts_gathered)))
        if fusion.explicit_layers:
            why = "attention sinks" if m.architecture.attention_sinks else "soft-capped scores"
            rows.append(Row(entry.index, f"explicit attention ({why} have no SDPA form)",
                            "MatMul/Softmax present", str(fusion.unfused_attention),
                            _verdict(fusion.unfused_attention > 0)))
        else:
            rows.append(Row(entry.index, "attention MatMul/Softmax left", "0", str(fusion.unfused_attention),
                            _verdict(fusion.unfused_attention == 0)))
        precisions = weight_precisions(compiled.get_runtime_model())
        found = ", ".join(f"{k}: {v}" for k, v in sorted(precisions.items()))
        wanted = _WEIGHT_TYPES.get(m.weights.mode)
        if wanted is None:
            rows.append(Row(entry.index, "weight storage", m.weights.mode, found, "pass"))
        else:
            # unpacked at load, or a router kept f32 on purpose: fine
            stored = {p for p in precisions if not p.endswith((" from compressed", " router", " zero points"))}
            ok = bool(stored) and stored <= wanted
            rows.append(Row(entry.index, "weight storage", f"{m.weights.mode}: {'/'.join(sorted(wanted))}",
                            found, _verdict(ok)))
    return rows


def gpu_runtime_rows(bundle: Path, m: Manifest, core: ov.Core) -> list[Row]:
    """IndirectKVCache signature: per layer, K and V ``kv_cache`` nodes reading ``beam_idx``.

    Untested on hardware here (no Intel GPU on these machines); the static predictor covers the
    GPU plugin's preconditions, and tests/compiler/test_predict.py runs this path where a GPU exists.
    """
    rows = []
    for entry in m.stages:
        runtime = core.compile_model(str(bundle / entry.model_xml), "GPU").get_runtime_model()
        layers = entry.layers[1] - entry.layers[0]
        kv_nodes = [op for op in runtime.get_ordered_ops()
                    if "kv_cache" in op.get_rt_info()["layerType"].astype(str).lower()]
        with_beam = [op for op in kv_nodes if any("beam_idx" in v.get_node().get_friendly_name()
                                                  for v in op.input_values())]
        rows.append(Row(entry.index, "GPU kv_cache nodes reading beam_idx", str(2 * layers), str(len(with_beam)),
                        _verdict(len(with_beam) == 2 * layers)))
    return rows


def prediction_rows(bundle: Path, m: Manifest, devices: tuple[str, ...]) -> list[Row]:
    from ovshard.verify.predict import predict_bundle

    rows = []
    for p in predict_bundle(bundle, m, devices):
        failed = [c for c in p.checks if not c.holds]
        rows.append(Row(p.stage, f"{p.device} fusion predicted (static)", f"{p.layers} layers",
                        f"{p.fused_layers} layers", _verdict(p.ok)))
        rows += [Row(p.stage, f"  {c.subject}: {c.condition}", "holds", c.detail, "FAIL") for c in failed]
    return rows


def verify_bundle(config: VerifyConfig) -> list[Row]:
    """Run every requested check; the caller decides the exit code from the verdicts."""
    if config.perplexity is not None and config.reference is None:
        raise ConfigError("--perplexity needs --reference CHECKPOINT: the bundle's perplexity is judged against "
                          "the reference's on the same tokens")
    bundle = Path(config.bundle)
    m = read_manifest(bundle)
    verify_files(bundle, m)
    rows = [Row(None, "file checksums", "as in manifest", "match", "pass")]
    core = ov.Core()
    if config.device:
        rows += runtime_rows(bundle, m, config.device, core)
    if config.predict:
        rows += prediction_rows(bundle, m, config.predict)
    if config.reference is not None:
        from ovshard.verify.reference import VerifyText, numerical_rows

        text = VerifyText(config.perplexity, config.perplexity_context) if config.perplexity else None
        rows += numerical_rows(bundle, m, config.reference, config.prompt, config.tokens, text)
    return rows


_WIDE = 48  # a "found" text longer than this goes on wrapped lines under its row


def format_report(rows: list[Row]) -> str:
    table = [["stage", "check", "expected", "found", "verdict"]]
    notes: dict[int, str] = {}
    for r in rows:
        found = r.found
        if len(found) > _WIDE:
            notes[len(table)], found = found, "(below)"
        table.append(["-" if r.stage is None else str(r.stage), r.check, r.expected, found, r.verdict])
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    lines = []
    for n, cells in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if n in notes:
            lines += textwrap.wrap(notes[n], width=110, initial_indent="         ", subsequent_indent="         ")
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    failed = sum(r.verdict == "FAIL" for r in rows)
    lines.append(f"\n{len(rows) - failed} passed or skipped, {failed} failed")
    return "\n".join(lines)


def report_json(rows: list[Row]) -> str:
    return json.dumps({"ok": all(r.verdict != "FAIL" for r in rows), "rows": [asdict(r) for r in rows]}, indent=2)
