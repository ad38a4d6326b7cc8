#!/usr/bin/env python
"""The CPU plugin's fully connected kernels on their own: weight formats x plugin settings x threads.

A decode step of a compressed model is mostly ``FullyConnectedCompressed`` nodes (every per-op profile says so:
docs/results/2026-12-one-node.md), so which weight format and which plugin settings run them fastest on a CPU
decides the runtime hints a bundle carries per instruction set (``ovshard.bundle.manifest``). Each case is a
chain of distinct MatMuls K -> N -> K -> ... whose compressed weights (random codes, the decompression chain
NNCF writes: Convert, Subtract of a zero point for asym, Multiply by a scale per group, Reshape, Convert) add up
to ``--mb`` megabytes, far past the last-level cache, so every step streams its weights from memory as a model
does; a row of M activations goes through (M=1: decode; M=512: a prompt). Reported per case: microseconds a
MatMul, and the weight bytes read per second (M=1) or the multiply-adds per second (M>1); beside them the
machine's copy bandwidth with the same thread count (numpy copies in threads, read + write counted).

    CI=true .venv/bin/python bench/cpu_kernels/fc_kernels.py [--shapes 2048x8192,576x1536] [--threads 1,2] [--rows 1]
        [--formats i4:128,i4:32,i4:-1,u4:128,u8:-1] [--settings bf16,f32dq32,f32dq128,f32nodq] [--mb 256]

Writes ``--out`` (bench/results)/fc_kernels.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (bench/report.py: JSON + table + plot)
from harness import command_line, machine  # noqa: E402

SETTINGS = {  # label -> CPU plugin properties (PERFORMANCE_HINT LATENCY in every case, as a stage runs)
    "bf16": {"INFERENCE_PRECISION_HINT": "bf16"},
    "f32": {"INFERENCE_PRECISION_HINT": "f32"},
    "f32dq32": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"},
    "f32dq128": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "f32nodq": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "plugin": {},  # the plugin's own defaults on this CPU
}
BITS = {"i4": 4, "u4": 4, "u8": 8, "f16": 16}


def log(message: str) -> None:
    print(f"[fc_kernels {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def weight(rng: np.random.Generator, k: int, n: int, fmt: str, group: int) -> ov.Output:
    """[n, k] f32 from stored codes, decompressed as NNCF writes it; ``group`` -1: one scale per row."""
    g = k if group < 0 or fmt in ("u8", "f16") else group
    if fmt == "f16":
        return ops.convert(ops.constant(rng.standard_normal((n, k)).astype(np.float16)), ov.Type.f32).output(0)
    if fmt in ("i4", "u4"):
        codes = ov.Tensor(ov.Type.i4 if fmt == "i4" else ov.Type.u4, ov.Shape([n, k // g, g]))
        codes.data[:] = rng.integers(0, 256, codes.data.shape, dtype=np.uint8)
        w = ops.convert(ov.op.Constant(codes, shared_memory=False), ov.Type.f16)
        if fmt == "u4":
            zero = ov.Tensor(ov.Type.u4, ov.Shape([n, k // g, 1]))
            zero.data[:] = 0x88
            w = ops.subtract(w, ops.convert(ov.op.Constant(zero, shared_memory=False), ov.Type.f16))
    else:
        w = ops.subtract(ops.convert(ops.constant(rng.integers(0, 256, (n, 1, k), dtype=np.uint8)), ov.Type.f16),
                         ops.convert(ops.constant(np.full((n, 1, 1), 128, np.uint8)), ov.Type.f16))
    scale = ops.constant((rng.random((n, k // g, 1)) * 0.01).astype(np.float16))
    shaped = ops.reshape(ops.multiply(w, scale), ops.constant(np.array([n, k], np.int64)), False)
    return ops.convert(shaped, ov.Type.f32).output(0)


def chain(k: int, n: int, fmt: str, group: int, megabytes: float) -> tuple[ov.Model, int, float]:
    """MatMuls K -> N -> K ... of ``megabytes`` of weights in all: (model, MatMuls, weight bytes)."""
    rng = np.random.default_rng(0)
    per_pair = 2 * k * n * BITS[fmt] / 8
    pairs = max(1, round(megabytes * 1e6 / per_pair))
    x = ops.parameter([-1, k], ov.Type.f32, name="x")
    h: ov.Output = x.output(0)
    for _ in range(pairs):
        h = ops.matmul(h, weight(rng, k, n, fmt, group), False, True).output(0)
        h = ops.matmul(h, weight(rng, n, k, fmt, group if group < 0 or n % group == 0 else -1), False, True).output(0)
    return ov.Model([h], [x], "fc_chain"), 2 * pairs, pairs * per_pair


def time_case(core: ov.Core, model: ov.Model, props: dict[str, str], rows: int, k: int, repeats: int) -> float:
    """Median seconds of one inference over ``rows`` rows."""
    request = core.compile_model(model, "CPU", props).create_infer_request()
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    for _ in range(3):
        request.infer({0: x})
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        request.infer({0: x})
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(threads: int, megabytes: float = 512) -> float:
    """GB/s of ``threads`` numpy copies side by side, read + write counted (numpy lets go of the GIL)."""
    n = int(megabytes * 1e6 / 8 / threads)
    sources = [np.ones(n) for _ in range(threads)]
    targets = [np.empty(n) for _ in range(threads)]
    best = 0.0
    for _ in range(3):
        workers = [threading.Thread(target=np.copyto, args=(t, s)) for s, t in zip(sources, targets, strict=True)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, 2 * 8 * n * threads / (time.perf_counter() - start) / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x8192,576x1536", help="KxN pairs (hidden x intermediate)")
    ap.add_argument("--threads", default=str(os.cpu_count() or 1))
    ap.add_argument("--rows", type=int, default=1, help="M: activations rows a MatMul (1 = decode)")
    ap.add_argument("--formats", default="i4:128,i4:32,i4:-1,u4:128,u8:-1", help="fmt:group (i4, u4, u8, f16)")
    ap.add_argument("--settings", default="bf16,f32dq32,f32dq128,f32nodq", help=f"of {','.join(SETTINGS)}")
    ap.add_argument("--mb", type=float, default=256, help="weight megabytes a chain holds (past the caches)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    core = ov.Core()
    rows: list[dict] = []
    for threads in (int(t) for t in args.threads.split(",")):
        bandwidth = copy_bandwidth(threads)
        log(f"{threads} threads: copy bandwidth {bandwidth:.1f} GB/s")
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            for spec in args.formats.split(","):
                fmt, group = spec.split(":")[0], int(spec.split(":")[1])
                model, count, nbytes = chain(k, n, fmt, group, args.mb)
                for label in args.settings.split(","):
                    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": str(threads), **SETTINGS[label]}
                    seconds = time_case(core, model, props, args.rows, k, args.repeats)
                    row = {"threads": threads, "shape": shape, "format": spec, "setting": label,
                           "us a MatMul": round(1e6 * seconds / count, 1),
                           "GB/s": round(nbytes / seconds / 1e9, 1), "copy GB/s": round(bandwidth, 1),
                           "of copy": round(nbytes / seconds / 1e9 / bandwidth, 2)}
                    if args.rows > 1:
                        row["GMAC/s"] = round(args.rows * nbytes * 8 / BITS[fmt] / seconds / 1e9, 1)
                    rows.append(row)
                    log(" ".join(f"{key}={value}" for key, value in row.items()))
    command = command_line()
    doc = {"target": "the format and setting fastest per instruction set (the bundle's CPU hints)", "rows": rows,
           "plot": {"group_by": "shape", "label": "{format} {setting} t{threads}", "value": "GB/s",
                    "ylabel": "weight GB/s" if args.rows == 1 else "GB/s"},
           "settings": {"rows (M)": args.rows, "weight MB a chain": args.mb}}
    md = report.write_scenario(args.out, "fc_kernels", "fully connected kernels: formats x settings x threads",
                               doc, machine(), command)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
