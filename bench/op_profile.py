#!/usr/bin/env python
"""Where one step of a one-stage bundle goes: OpenVINO's performance counters per op type and per layer.

The bundle's stage is loaded as a node loads it (paged attention, the last stage's logits sliced to the rows a
step reads, the bundle's CPU hints for this CPU under ``--prop`` overrides), a prompt of ``--context`` tokens is
prefilled, then ``--steps`` decode steps are timed with the counters on: each node's time (the mean over the
steps), summed per op type and per layer, with the weight bytes each fully connected node reads (its compressed
inputs' shapes and types in the compiled runtime graph) and what that is per second; beside them the step's wall
time, whose difference from the nodes' sum is everything around the kernels (the infer call, the inputs, the
plugin between nodes). ``--prefill N`` profiles a step of N new tokens instead (the first token of a prompt).

A layer here is the run of nodes up to and including its attention node, in execution order: layer 0 holds the
embedding and q/k/v of layer 0; layer i its own q/k/v and the o/MLP projections of layer i-1; "head" the last
layer's o/MLP, the final norm and the lm_head.

    CI=true .venv/bin/python bench/op_profile.py BUNDLE [--threads 2] [--context 64] [--steps 32]
        [--prefill 512] [--static-decode] [--prop KEY=VALUE ...] [--out bench/results] [--name op_profile]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import report  # noqa: E402
from harness import command_line, describe, machine  # noqa: E402

ATTENTION = ("PagedAttentionExtension", "ScaledDotProductAttentionWithKVCache")


def weight_bytes(runtime: ov.Model) -> dict[str, int]:
    """Bytes of the constant inputs (weights, scales, zero points) each fully connected node reads a step."""
    found = {}
    for op in runtime.get_ordered_ops():
        if not str(op.get_rt_info()["layerType"].astype(str)).startswith("FullyConnected"):
            continue
        total = 0
        for i in range(1, op.get_input_size()):
            shape, kind = op.input_value(i).get_partial_shape(), op.input_value(i).get_element_type()
            if shape.is_static and kind.is_static():
                total += int(np.prod(shape.to_shape(), dtype=np.int64)) * kind.bitwidth // 8
        found[op.get_friendly_name()] = total
    return found


def _totals(request: ov.InferRequest, inferences: int, kinds: dict[str, str] | None = None) -> dict[str, float]:
    """Each executed node's seconds summed over ``inferences`` (the counters hold the mean since compiling)."""
    found = {}
    for info in request.get_profiling_info():
        if info.status == info.Status.EXECUTED:
            found[info.node_name] = info.real_time.total_seconds() * inferences
            if kinds is not None:
                kinds[info.node_name] = f"{info.node_type} ({info.exec_type})"
    return found


def profile(bundle: Path, threads: int, context: int, steps: int, prefill: int, props: dict[str, str],
            static: bool = False) -> dict:
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.paged import PagedRows, compile_paged
    from ovshard.runtime.engine.stage import plugin_config

    manifest = read_manifest(bundle)
    if manifest.num_stages != 1:
        raise SystemExit(f"{bundle} has {manifest.num_stages} stages: profile a one-stage bundle")
    config = {"PERF_COUNT": "YES", "INFERENCE_NUM_THREADS": str(threads), **props}
    length = context + max(prefill, steps) + 1
    blocks = list(range(-(-length // 32)))
    stage = compile_paged(ov.Core(), bundle, manifest, 0, config=config, num_blocks=len(blocks), slice_logits=True,
                          static_decode=static)
    vocab = manifest.architecture.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, length).astype(np.int64)
    if prefill:  # the same prompt again and again (each run rewrites the positions the last one wrote)
        runs = [(ids[context:context + prefill], context)] * max(1, steps // 8)
    else:
        runs = [(ids[context + i:context + i + 1], context + i) for i in range(steps)]
    warm = ([(ids[:context], 0)] if context else []) + [runs[0]]
    for x, position in warm:
        stage.run([PagedRows(x, position, blocks, 1)])
    kinds, order, walls = {}, {}, []
    # The plugin's counters are each node's mean over every inference since the model was compiled: the profiled
    # runs' own mean is (total after them - total before them) / their count, totals being mean x inferences.
    # A decode step with --static-decode runs on the static copy's request (it counts its inferences); every other
    # step on the dynamic one, whose inferences are the load's 2-token warm-up step (and its 1-token one when
    # no static copy takes it) and the warm runs here.
    decode = stage.decode if static and not prefill else None
    request, compiled = (stage.request, stage.compiled) if decode is None else (decode.request, decode.compiled)
    done = decode.inferences if decode is not None else len(warm) + (1 if stage.decode else 2)
    before = _totals(request, done)
    for x, position in runs:
        start = time.perf_counter()
        stage.run([PagedRows(x, position, blocks, 1)])
        walls.append(time.perf_counter() - start)
    after = _totals(request, done + len(runs), kinds)
    times = {name: max(0.0, (total - before.get(name, 0.0)) / len(runs)) for name, total in after.items()}
    for n, op in enumerate(compiled.get_runtime_model().get_ordered_ops()):
        order[op.get_friendly_name()] = n
    reads = weight_bytes(compiled.get_runtime_model())
    applied = plugin_config(manifest, "CPU", config)
    return {"times": dict(times), "kinds": kinds, "order": order, "reads": reads, "wall_s": statistics.median(walls),
            "properties": {k: str(compiled.get_property(k)) for k in (
                "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
                "INFERENCE_NUM_THREADS", "ENABLE_CPU_PINNING")}, "asked": applied}


def tables(found: dict) -> tuple[list[dict], list[dict], dict]:
    """Rows per op type, rows per layer, and the step's summary."""
    times, kinds, reads = found["times"], found["kinds"], found["reads"]
    total = sum(times.values())
    per_type: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0])
    for name, seconds in times.items():
        entry = per_type[kinds[name]]
        entry[0] += seconds
        entry[1] += 1
        entry[2] += reads.get(name, 0)
    by_type = [{"op (kernel)": kind, "nodes": n, "ms": round(1e3 * s, 3), "share": round(s / total, 3),
                "weights MB": round(b / 1e6, 1), "weights GB/s": round(b / s / 1e9, 1) if b else ""}
               for kind, (s, n, b) in sorted(per_type.items(), key=lambda kv: -kv[1][0])]
    layer, per_layer = 0, collections.defaultdict(float)
    for name in sorted(times, key=lambda n: found["order"].get(n, 0)):
        per_layer[layer] += times[name]
        if kinds[name].split(" ")[0] in ATTENTION:
            layer += 1
    by_layer = [{"layer": "head" if i == layer else i, "ms": round(1e3 * s, 3)} for i, s in sorted(per_layer.items())]
    fc_bytes = sum(found["reads"].values())
    summary = {"step wall ms": round(1e3 * found["wall_s"], 3), "nodes' sum ms": round(1e3 * total, 3),
               "outside the nodes ms": round(1e3 * (found["wall_s"] - total), 3), "nodes": len(times),
               "weights read MB": round(fc_bytes / 1e6, 1),
               "weights GB/s over the step": round(fc_bytes / found["wall_s"] / 1e9, 1)}
    return by_type, by_layer, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--context", type=int, default=64, help="tokens cached before the profiled steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=0, help="profile one step of this many new tokens instead")
    ap.add_argument("--static-decode", action="store_true", help="decode steps on the static copy (static_step.py)")
    ap.add_argument("--prop", action="append", default=[], help="KEY=VALUE: a CPU plugin property over the hints")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--name", default="op_profile")
    args = ap.parse_args()
    props = dict(p.split("=", 1) for p in args.prop)
    found = profile(args.bundle, args.threads, args.context, args.steps, args.prefill, props, args.static_decode)
    by_type, by_layer, summary = tables(found)
    doc = {"command": command_line(), "machine": machine(), "bundle": str(args.bundle), "threads": args.threads, "context": args.context,
           "step": f"prefill of {args.prefill}" if args.prefill else f"decode, mean of {args.steps} steps",
           "properties": found["properties"], "summary": summary, "by_type": by_type, "by_layer": by_layer}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    text = "\n".join([describe(doc["machine"]), ""] + [f"{k}: {v}" for k, v in summary.items()] + ["", report.markdown_table(by_type), "",
                      report.markdown_table(by_layer)])
    (args.out / f"{args.name}.md").write_text(text + "\n")
    print(f"properties: {found['properties']}\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
