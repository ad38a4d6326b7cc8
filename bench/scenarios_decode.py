"""Decode-speed scenarios: a (pipeline vs monolithic), b (beam_idx Gather), c (vs openvino-genai),
g (achieved rate vs a memory-bandwidth bound). Each measures its variants interleaved in one process."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
from scenarios_base import (
    Bench,
    LocalDecoder,
    Measured,
    ModelSpec,
    Sample,
    TcpDecoder,
    interleaved,
    median,
    progress,
    scenario,
    timed_greedy,
)

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.engine.stage import step_inputs

STAGE_COUNTS = (1, 2, 4)
PIPELINE_TARGET = 0.98  # pipeline / monolithic decode tok/s (the paper: 0.96 on GPU after its fix 2)
GENAI_TARGET = 1.0  # ovshard / openvino-genai (the paper's shards: 0.94-1.0)
BEAM_GATHER = "InjectBeamIdxGatherPass"


def _settings(bench: Bench, model: ModelSpec) -> dict[str, Any]:
    return {"prompt_ids": list(model.prompt), "new_tokens": bench.settings.tokens(model),
            "decode_steps": bench.settings.tokens(model) - 1, "rounds": bench.settings.rounds,
            "warmup": bench.settings.warmup}


def _measure(bench: Bench, model: ModelSpec, decoders: dict[str, Any], label: str) -> Measured:
    return interleaved(decoders, list(model.prompt), bench.settings.tokens(model), bench.settings.rounds,
                       bench.settings.warmup, label)


# ------------------------------------------------------------------------------------------- a


@scenario("a", "pipeline (2, 4 stages) vs monolithic decode, in-process and over loopback TCP")
def pipeline_vs_monolithic(bench: Bench) -> dict[str, Any]:
    rows, summary, raw, settings = [], [], {}, {}
    for model in bench.models:
        bundles = {n: bench.bundle(model, n) for n in STAGE_COUNTS}
        with ExitStack() as stack:
            decoders: dict[str, Any] = {f"local {n}st": LocalDecoder(b) for n, b in bundles.items()}
            for n, b in bundles.items():
                tcp = TcpDecoder(b, stack.enter_context(local_workers(b)))
                stack.callback(tcp.close)
                decoders[f"tcp {n}st"] = tcp
            measured = _measure(bench, model, decoders, f"a {model.name}")
        raw[model.name], settings[model.name] = measured.raw(), _settings(bench, model)
        for transport in ("local", "tcp"):
            base = f"{transport} 1st"
            for n in STAGE_COUNTS:
                v = f"{transport} {n}st"
                ratio = measured.ratio(v, base)
                rows.append({"model": model.name, "runtime": "in-process" if transport == "local" else "loopback TCP",
                             "stages": n, "decode tok/s (median)": round(measured.median_tps(v), 2),
                             "vs 1 stage": round(ratio, 3),
                             "vs 1 stage (ratio of medians)": round(measured.median_tps(v) / measured.median_tps(base), 3),
                             "vs in-process": round(measured.ratio(v, f"local {n}st"), 3),
                             "same tokens as 1 stage": measured.samples[v][0].tokens == measured.samples[base][0].tokens})
                if n > 1:
                    summary.append({"measure": f"{n} stages / 1 stage, {rows[-1]['runtime']} decode tok/s",
                                    "model": model.name, "value": f"{ratio:.3f}x", "target": f">= {PIPELINE_TARGET}x"})
    return {
        "target": f"pipeline decode tok/s >= {PIPELINE_TARGET}x monolithic, same runtime (paper: 0.96x)",
        "settings": {"what": "greedy decode tok/s = decode steps / their summed wall time (prefill excluded); "
                             "in-process: LocalPipeline.forward + argmax per step; TCP: Head.generate round trip "
                             "per step (the last stage returns argmax), one `ovshard serve` process per stage",
                     "bundles": "int4_sym (default weights), balanced split", "per_model": settings},
        "rows": rows, "summary": summary, "samples": raw,
        "notes": ["ratios are medians of per-round ratios (each round runs every variant once, interleaved); "
                  "'ratio of medians' divides the medians instead: where the two disagree, the noise is larger "
                  "than the difference",
                  "different splits quantize differently (each stage's last MatMul stays INT8), so the "
                  "tokens of random-weight models may differ between splits"],
        "plot": {"ylabel": "decode tok/s", "group_by": "model", "label": "{runtime}, {stages} stage(s)",
                 "value": "decode tok/s (median)"},
    }


# ------------------------------------------------------------------------------------------- b


class RawDecoder:
    """A one-stage bundle driven through its own InferRequest, fed only the inputs its IR declares, so
    that it runs the IR compiled without the beam_idx Gather (no beam_idx input) the same way."""

    def __init__(self, bundle: Path) -> None:
        manifest = read_manifest(bundle)
        if manifest.num_stages != 1:
            raise ValueError(f"{bundle} has {manifest.num_stages} stages; RawDecoder runs one-stage bundles")
        self.layers = manifest.stages[0].layers[1] - manifest.stages[0].layers[0]
        self.max_positions = manifest.runtime_hints.max_positions
        self.compiled = ov.Core().compile_model(str(bundle / manifest.stages[0].model_xml), "CPU")
        self.request = self.compiled.create_infer_request()
        self.inputs = {name for port in self.compiled.inputs for name in port.get_names()}
        self.mask: list[int] = []

    def reset(self) -> None:
        self.request.reset_state()
        self.mask = []

    def forward(self, ids: list[int]) -> np.ndarray:
        position = len(self.mask)
        self.mask += [1] * len(ids)
        feed = step_inputs(names.INPUT_IDS, np.array([ids], dtype=np.int64), self.mask, position, self.max_positions)
        out = self.request.infer({k: v for k, v in feed.items() if k in self.inputs})
        return out[self.compiled.output(0)][0]  # [T, V]

    def greedy(self, prompt: list[int], new_tokens: int) -> Sample:
        return timed_greedy(self.forward, self.reset, prompt, new_tokens)


@scenario("b", "with vs without the beam_idx Gather (InjectBeamIdxGatherPass), one stage, in-process")
def beam_gather(bench: Bench) -> dict[str, Any]:
    from ovshard.verify.fusion import runtime_fusion

    rows, summary, raw, settings = [], [], {}, {}
    for model in bench.models:
        decoders = {"with Gather": RawDecoder(bench.bundle(model, 1)),
                    "without Gather": RawDecoder(bench.bundle(model, 1, skip=(BEAM_GATHER,)))}
        measured = _measure(bench, model, decoders, f"b {model.name}")
        raw[model.name], settings[model.name] = measured.raw(), _settings(bench, model)
        for v, dec in decoders.items():
            fusion = runtime_fusion(dec.compiled, 0, dec.layers)
            rows.append({"model": model.name, "variant": v, "decode tok/s (median)": round(measured.median_tps(v), 2),
                         "vs with Gather": round(measured.ratio(v, "with Gather"), 3),
                         "(ratio of medians)": round(measured.median_tps(v) / measured.median_tps("with Gather"), 3),
                         "fused SDPA / layers": f"{fusion.fused_sdpa}/{fusion.layers}",
                         "SDPA nodes": fusion.runtime_ops.get("ScaledDotProductAttention", 0),
                         "attention MatMul+Softmax left": fusion.unfused_attention,
                         "CPU fusion": "yes" if fusion.ok else "no"})
        speedup = measured.ratio("with Gather", "without Gather")
        summary.append({"measure": "with / without beam_idx Gather, decode tok/s", "model": model.name,
                        "value": f"{speedup:.3f}x (fused: {rows[-2]['CPU fusion']} / {rows[-1]['CPU fusion']})",
                        "target": "> 1x, fusion fires only with the Gather"})
    return {
        "target": "the Gather makes the CPU fuse the KV cache into SDPA (StatefulSDPAFusion) and decode faster "
                  "(measured: ~14% on a 1.2B model at 70 tokens of context, ~5x on a tiny one)",
        "settings": {"what": "one-stage int4_sym bundles compiled with and without InjectBeamIdxGatherPass "
                             "(CompileConfig.skip_passes), run through the same InferRequest loop feeding only the "
                             "inputs each IR declares; fusion read off compiled.get_runtime_model() (ovshard.verify.fusion)",
                     "per_model": settings},
        "rows": rows, "summary": summary, "samples": raw,
        "notes": ["ratios are medians of per-round ratios (interleaved rounds); '(ratio of medians)' divides the "
                  "medians instead: where the two disagree, the noise is larger than the difference"],
        "plot": {"ylabel": "decode tok/s", "group_by": "model", "label": "{variant}", "value": "decode tok/s (median)"},
    }


# ------------------------------------------------------------------------------------------- c


class GenaiDecoder:
    """openvino_genai.LLMPipeline on the same one-stage bundle, greedy, fed the same prompt ids."""

    def __init__(self, bundle: Path, backend: str) -> None:
        import openvino_genai

        self.genai = openvino_genai
        self.pipe = openvino_genai.LLMPipeline(str(bundle), "CPU", ATTENTION_BACKEND=backend)

    def greedy(self, prompt: list[int], new_tokens: int) -> Sample:
        config = self.genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.do_sample = False
        start = time.perf_counter()
        result = self.pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), config)
        wall = time.perf_counter() - start
        metrics = result.perf_metrics
        # m_durations: microseconds from one generated token to the next; [0] ends with the first token
        durations = list(metrics.raw_metrics.m_durations)
        return Sample(list(result.tokens[0]), len(durations) - 1, sum(durations[1:]) / 1e6,
                      metrics.get_ttft().mean / 1e3, wall)


@scenario("c", "ovshard one stage vs openvino_genai.LLMPipeline on the same bundle")
def versus_genai(bench: Bench) -> dict[str, Any]:
    rows, summary, raw, settings = [], [], {}, {}
    for model in bench.models:
        bundle = bench.bundle(model, 1)
        decoders = {"ovshard": LocalDecoder(bundle), "genai SDPA": GenaiDecoder(bundle, "SDPA"),
                    "genai PA": GenaiDecoder(bundle, "PA")}
        measured = _measure(bench, model, decoders, f"c {model.name}")
        raw[model.name], settings[model.name] = measured.raw(), _settings(bench, model)
        for v in decoders:
            wall = [s.wall_s for s in measured.samples[v]]
            rows.append({"model": model.name, "runtime": v, "decode tok/s (median)": round(measured.median_tps(v), 2),
                         "ovshard / this": round(measured.ratio("ovshard", v), 3),
                         "(ratio of medians)": round(measured.median_tps("ovshard") / measured.median_tps(v), 3),
                         "whole generate s (median)": round(median(wall), 3),
                         "same tokens as ovshard": measured.samples[v][0].tokens == measured.samples["ovshard"][0].tokens})
        for v in ("genai SDPA", "genai PA"):
            summary.append({"measure": f"ovshard 1 stage / {v}, decode tok/s", "model": model.name,
                            "value": f"{measured.ratio('ovshard', v):.3f}x", "target": f">= {GENAI_TARGET}x"})
    return {
        "target": f"ovshard one stage >= {GENAI_TARGET}x openvino-genai decode tok/s (paper: 0.94-1.0x)",
        "settings": {"what": "decode tok/s = decode steps / decode seconds, the first token (prefill) excluded on "
                             "both sides. ovshard: LocalPipeline, each step timed around forward(1 token) + numpy "
                             "argmax. genai: LLMPipeline.generate(ids tensor) with max_new_tokens = "
                             "min_new_tokens = N, do_sample False; decode seconds = sum of "
                             "perf_metrics.raw_metrics.m_durations[1:] (token-to-token intervals, the same as "
                             "mean TPOT). Both with the CPU plugin's default hints. 'whole generate' is the "
                             "wall time of one generation, prefill included",
                     "genai backends": "SDPA (stateful, like ovshard) and PA (paged attention, genai's x86 default)",
                     "per_model": settings},
        "rows": rows, "summary": summary, "samples": raw,
        "notes": ["ratios are medians of per-round ratios (interleaved rounds); '(ratio of medians)' divides the "
                  "medians instead: where the two disagree, the noise is larger than the difference"],
        "plot": {"ylabel": "decode tok/s", "group_by": "model", "label": "{runtime}", "value": "decode tok/s (median)"},
    }


# ------------------------------------------------------------------------------------------- g


def copy_bandwidth(size: int = 1 << 30, repeats: int = 4) -> dict[str, float]:
    """Best (bytes read + written) / s of numpy copies of a ``size``-byte array, 1 thread and 2 threads
    (each copying half; numpy releases the GIL during the copy)."""
    src = np.ones(size // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best: dict[str, float] = {}
    for threads in (1, 2):
        step = src.size // threads
        halves = [(src[i * step:(i + 1) * step], dst[i * step:(i + 1) * step]) for i in range(threads)]
        for _ in range(repeats):
            pool = [threading.Thread(target=np.copyto, args=(d, s)) for s, d in halves]
            start = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            rate = 2 * size / (time.perf_counter() - start)
            best[f"{threads} thread"] = max(best.get(f"{threads} thread", 0.0), rate)
    return best


def _const_derived(model: ov.Model) -> dict[int, bool]:
    """For every op: is its value computed from Constants only (a weight and its decompression)?"""
    derived: dict[int, bool] = {}
    for op in model.get_ordered_ops():  # topological order
        kind = op.get_type_name()
        inputs = [v.get_node() for v in op.input_values()]
        derived[op.get_instance_id()] = kind == "Constant" or (
            bool(inputs) and kind not in ("Parameter", "ReadValue")
            and all(derived.get(i.get_instance_id(), False) for i in inputs))
    return derived


def weight_bytes(xml: Path) -> dict[str, int]:
    """Constant bytes a decode step reads, from the IR: every Constant feeding a compute op counts, except
    those that only feed the data input of a Gather by runtime indices (embedding, rotary table), which
    reads one row per token. A Constant shared by a Gather and a MatMul (tied embedding) counts as read."""
    model = ov.Core().read_model(str(xml))
    derived = _const_derived(model)
    gathered, read = {}, {}
    for op in model.get_ordered_ops():
        if derived[op.get_instance_id()]:
            continue
        for port, value in enumerate(op.input_values()):
            source = value.get_node()
            if not derived[source.get_instance_id()]:
                continue
            target = gathered if op.get_type_name() == "Gather" and port == 0 else read
            stack = [source]
            while stack:
                node = stack.pop()
                if node.get_type_name() == "Constant":
                    target[node.get_instance_id()] = node.get_byte_size()
                else:
                    stack += [v.get_node() for v in node.input_values()]
    only_gathered = {k: v for k, v in gathered.items() if k not in read}
    return {"read_per_token": sum(read.values()), "gathered_only": sum(only_gathered.values()),
            "bin_file": xml.with_suffix(".bin").stat().st_size}


def _kv_bytes_per_token(bench: Bench, model: ModelSpec, bundle: Path, element_bytes: float) -> float:
    """KV cache read per decode step at the mean context of the measurement (grows with context)."""
    dims = read_manifest(bundle).architecture
    context = len(model.prompt) + bench.settings.tokens(model) / 2
    return dims.num_layers * 2 * dims.num_kv_heads * dims.head_dim * context * element_bytes


@scenario("g", "achieved decode rate vs a memory-bandwidth bound (one stage, in-process)")
def bandwidth_bound(bench: Bench) -> dict[str, Any]:
    progress("g: measuring copy bandwidth (1 GiB numpy copies)")
    bandwidth = copy_bandwidth()
    best_bw = max(bandwidth.values())
    rows, summary, raw, settings = [], [], {}, {}
    for model in bench.models:
        bundle = bench.bundle(model, 1)
        decoder = LocalDecoder(bundle)
        measured = _measure(bench, model, {"ovshard 1st": decoder}, f"g {model.name}")
        raw[model.name], settings[model.name] = measured.raw(), _settings(bench, model)
        kv_type = decoder.pipeline.stages[0].compiled.get_property("KV_CACHE_PRECISION").get_type_name()
        kv_elem = {"u8": 1.0, "i8": 1.0, "f16": 2.0, "bf16": 2.0, "f32": 4.0, "u4": 0.5}.get(kv_type, 2.0)
        weights = weight_bytes(bundle / read_manifest(bundle).stages[0].model_xml)
        kv = _kv_bytes_per_token(bench, model, bundle, kv_elem)
        per_token = weights["read_per_token"] + kv
        bound = best_bw / per_token
        tps = measured.median_tps("ovshard 1st")
        rows.append({"model": model.name, ".bin MB": round(weights["bin_file"] / 1e6, 1),
                     "gathered-only MB": round(weights["gathered_only"] / 1e6, 1),
                     "weights read/token MB": round(weights["read_per_token"] / 1e6, 1),
                     f"KV read/token MB ({kv_type})": round(kv / 1e6, 2),
                     "copy GB/s": round(best_bw / 1e9, 2), "bound tok/s": round(bound, 1),
                     "measured tok/s (median)": round(tps, 2), "achieved / bound": round(tps / bound, 3)})
        summary.append({"measure": "decode tok/s / memory-bandwidth bound", "model": model.name,
                        "value": f"{tps / bound:.3f} ({tps:.1f} of {bound:.0f} tok/s)",
                        "target": "close to 1 when weight reads dominate"})
    return {
        "target": "achieved decode rate close to the bound bandwidth / bytes read per token (decode is "
                  "memory-bound when the weights do not fit in cache)",
        "settings": {"bandwidth": {k: round(v / 1e9, 3) for k, v in bandwidth.items()} | {"unit": "GB/s"},
                     "what": "bandwidth = best (bytes read + written) / s of numpy copies of 1 GiB, 1 and 2 "
                             "threads, best taken. bytes per token = bytes of the IR Constants a step reads (all "
                             "weights feeding compute; Constants that only feed a Gather by runtime indices, "
                             "i.e. the untied embedding rows and the rotary table, excluded) + the KV cache at "
                             "the mean context of the run. Activations and cache effects ignored: for a model "
                             "that fits in cache (stories260K) the bound is meaningless",
                     "per_model": settings},
        "rows": rows, "summary": summary, "samples": raw,
        "notes": ["a copy's reads and writes both count; decode mostly reads, and read-only bandwidth can be "
                  "higher than copy bandwidth, so the bound is approximate"],
        "plot": {"ylabel": "tok/s", "group_by": "model", "bars": ["bound tok/s", "measured tok/s (median)"]},
    }
