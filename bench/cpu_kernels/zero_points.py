#!/usr/bin/env python
"""INT4 weights with f16 zero points, as stored and split by SplitZeroPointsPass: speed and error on the CPU plugin.

``int4_affine`` (llama.cpp's Q4_1 blocks as they are) keeps a float zero point a group, which keeps the CPU
plugin's fully connected nodes off its int8 path (dynamic quantization of the activations); the pass rewrites
each such weight as signed codes with no zero point plus a MatMul of the input's group sums
(passes/split_zero_points.py). Each case is a chain of residual blocks ``h += W2 (W1 h)`` with an RMS
normalisation after each, W1 [N, K] and W2 [K, N] made of Q4_1-like blocks (a block's minimum at code 0, its
maximum at 15), compiled three ways side by side in one process: the affine form with f32 activations (what
the stored form computes: the reference), the affine form with the bundle's hints, and the split form with
the same hints. Reported per shape and threads: milliseconds a chain (medians of interleaved rounds) and the
relative L2 error of the chain's output against the reference.

    CI=true .venv/bin/python bench/cpu_kernels/zero_points.py [--shapes 576x1536,2048x8192] [--blocks 30,8]
        [--threads 2] [--rounds 5]

Writes ``--out`` (bench/results)/zero_points.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (bench/report.py: JSON + table + plot)
from harness import command_line, machine, progress  # noqa: E402

from ovshard.passes.compress_weights import int4_affine_weight  # noqa: E402
from ovshard.passes.split_zero_points import float_zero_point_weights, split  # noqa: E402

HINTS = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32", "PERFORMANCE_HINT": "LATENCY"}


def q4_1(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols // 32, 32] weights of Q4_1 blocks: ``m + d k``, k in [0, 15], the block's minimum at 0, max at 15."""
    d = rng.uniform(0.002, 0.02, (rows, cols // 32, 1))
    m = -d * rng.uniform(4, 11, (rows, cols // 32, 1))
    k = rng.integers(0, 16, (rows, cols // 32, 32))
    k[..., 0], k[..., 1] = 0, 15
    return (m + d * k).astype(np.float32)


def chain(k: int, n: int, blocks: int, split_them: bool) -> ov.Model:
    rng = np.random.default_rng(0)
    x = ops.parameter([-1, -1, k], ov.Type.f32, name="x")
    h: ov.Output = x.output(0)
    for i in range(blocks):
        up = ops.matmul(h, int4_affine_weight(f"w1_{i}", q4_1(rng, n, k), (n, k)), False, True)
        h = ops.add(h, ops.matmul(up, int4_affine_weight(f"w2_{i}", q4_1(rng, k, n), (k, n)), False, True)).output(0)
        norm = ops.sqrt(ops.reduce_mean(ops.multiply(h, h), ops.constant(np.array([-1], np.int64)), True))
        h = ops.divide(h, norm).output(0)
    model = ov.Model([h], [x], "affine_chain")
    if split_them:
        for weight in float_zero_point_weights(model):
            split(weight)
        model.validate_nodes_and_infer_types()
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="576x1536,2048x8192", help="KxN pairs (hidden x intermediate)")
    ap.add_argument("--blocks", default="30,8", help="residual blocks a chain, one per shape")
    ap.add_argument("--threads", default=str(os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    core, rows = ov.Core(), []
    shapes, blocks = args.shapes.split(","), [int(b) for b in args.blocks.split(",")]
    if len(blocks) != len(shapes):
        raise SystemExit(f"--blocks: expected one count per shape ({len(shapes)}), got {args.blocks}")
    for threads in (int(t) for t in args.threads.split(",")):
        for shape, count in zip(shapes, blocks, strict=True):
            k, n = (int(v) for v in shape.split("x"))
            x = np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)
            affine, parted = chain(k, n, count, False), chain(k, n, count, True)
            exact = core.compile_model(affine, "CPU", {**HINTS, "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
                                                       "INFERENCE_NUM_THREADS": str(threads)})
            reference = exact(x)[0]
            props = {**HINTS, "INFERENCE_NUM_THREADS": str(threads)}
            cases = {"affine": core.compile_model(affine, "CPU", props).create_infer_request(),
                     "split": core.compile_model(parted, "CPU", props).create_infer_request()}
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.rounds):
                for name, request in cases.items():
                    request.infer({0: x})
                    samples = []
                    for _ in range(20):
                        start = time.perf_counter()
                        request.infer({0: x})
                        samples.append(time.perf_counter() - start)
                    times[name].append(statistics.median(samples))
            for name, request in cases.items():
                out = request.infer({0: x})[0]
                row = {"threads": threads, "shape": shape, "blocks": count, "form": name,
                       "ms a chain": round(1e3 * statistics.median(times[name]), 3),
                       "vs affine": round(statistics.median(times["affine"]) / statistics.median(times[name]), 2),
                       "rel. error vs f32": float(f"{np.linalg.norm(out - reference) / np.linalg.norm(reference):.2e}")}
                rows.append(row)
                progress(" ".join(f"{key}={value}" for key, value in row.items()), "zero_points")
    doc = {"target": "the split form faster than the affine one, its error that of int8 activations", "rows": rows,
           "plot": {"group_by": "shape", "label": "{form} t{threads}", "value": "ms a chain", "ylabel": "ms a chain"},
           "settings": {"hints": HINTS, "rounds": args.rounds}}
    md = report.write_scenario(args.out, "zero_points", "f16 zero points: stored against split", doc, machine(),
                               command_line())
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
