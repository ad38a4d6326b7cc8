"""Where a decode step's time goes, and which CPU plugin settings are fastest here.

Two parts, each interleaved in rounds (timings drift between processes, so only ratios within a run count):

- ``paths``: ``ovshard run --local`` three ways: every stage in the CLI's process on paged attention
  (``--in-process``, what a one-stage bundle runs by default), the same on stateful stages (``--kv stateful``),
  and a worker process per stage over loopback TCP (``--workers``), each as a user runs it (``--speculative off
  --stats json``): decode tokens/s, the stages' compute per step, and what the step costs beyond it (the
  head's sampler and Python; with workers also framing, the socket hops and the thread hand-offs);
- ``settings``: the bundle's stage 0 (a one-stage bundle: the whole model) under each CPU plugin setting,
  in one process, a stream of single-token steps after a short prompt: ms per step.

    .venv/bin/python bench/against_llama_cpp/decode_overhead.py [BUNDLE] [--rounds 3] [--tokens 128] [--part paths,settings]

Writes bench/results/decode_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import RESULTS, write_results  # noqa: E402  (bench/ is not a package)

SETTINGS = {
    "default": {},
    "threads=1": {"INFERENCE_NUM_THREADS": "1"},
    "threads=1, no pinning": {"INFERENCE_NUM_THREADS": "1", "ENABLE_CPU_PINNING": "NO"},
    "THROUGHPUT hint": {"PERFORMANCE_HINT": "THROUGHPUT"},
    "f32 inference": {"INFERENCE_PRECISION_HINT": "f32"},
    "KV cache u8": {"KV_CACHE_PRECISION": "u8"},
    "KV cache f32": {"KV_CACHE_PRECISION": "f32"},
    "no dynamic quantization": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "dynamic quantization group 64": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "64"},
    "dynamic quantization group 128": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "dynamic quantization group 256": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "256"},
    "KV u8 + group 128": {"KV_CACHE_PRECISION": "u8", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "f32 + group 128": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "f32 + KV u8 + group 128": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "u8",
                                "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
}


def log(message: str) -> None:
    print(f"[decode_overhead {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


PATHS = {"in-process paged": ["--in-process"], "in-process stateful": ["--in-process", "--kv", "stateful"],
         "workers over TCP": ["--workers"]}


def run_cli(bundle: Path, tokens: int, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "ovshard.cli", "-q", "run", str(bundle), "--local", "--prompt-ids", "1,2,3,4,5",
           "--max-tokens", str(tokens), "--speculative", "off", "--stats", "json", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    compute = sum(v for k, v in stats.items() if k.startswith("stage") and k.endswith("_compute_ms"))
    return {"tokens_per_s": stats["decode_tokens_per_s"], "step_ms": stats["mean_step_ms"], "compute_ms": compute,
            "beyond_compute_ms": round(stats["mean_step_ms"] - compute, 3)}


def paths(bundle: Path, rounds: int, tokens: int) -> dict:
    found: dict[str, list[dict]] = {name: [] for name in PATHS}
    for r in range(rounds):
        for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
            found[name].append(run_cli(bundle, tokens, PATHS[name]))
            log(f"round {r}: {name}: {found[name][-1]}")
    workers = found["workers over TCP"]
    over_workers = {name: round(statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                                  for a, b in zip(runs, workers, strict=True)), 3)
                    for name, runs in found.items() if name != "workers over TCP"}
    summary = {name: {key: statistics.median(x[key] for x in runs) for key in runs[0]} for name, runs in found.items()}
    return {"runs": found, "median": summary, "over_workers": over_workers}


def settings(bundle: Path, rounds: int, tokens: int) -> dict:
    import openvino as ov

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.stage import Stage

    manifest = read_manifest(bundle)
    if manifest.num_stages != 1:
        raise SystemExit(f"{bundle} has {manifest.num_stages} stages: the settings part times a one-stage bundle")
    core = ov.Core()
    stages = {name: Stage(bundle, manifest, 0, core, "CPU", config, slice_logits=True)
              for name, config in SETTINGS.items()}
    found: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(rounds):
        for name in (list(stages) if r % 2 == 0 else list(stages)[::-1]):
            stage = stages[name]
            stage.reset()
            stage.step(np.array([[1, 2, 3, 4, 5]], dtype=np.int64), 0, rows=1)
            start = time.perf_counter()
            for i in range(tokens):
                stage.step(np.array([[7]], dtype=np.int64), 5 + i, rows=1)
            found[name].append(1e3 * (time.perf_counter() - start) / tokens)
        log(f"round {r}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in found.items()))
    base = found["default"]
    return {name: {"step_ms": round(statistics.median(v), 3),
                   "vs_default": round(statistics.median(d / x for d, x in zip(base, v, strict=True)), 3)}
            for name, v in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?",
                    help="a one-stage bundle (default: the real Gemma 3 270M's default compile, made by bench/peers.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--part", default="paths,settings")
    args = ap.parse_args()
    if args.bundle is None:
        sys.path.insert(0, str(HERE))
        from peers import bundle

        args.bundle = bundle("gemma3-270m", 1)
    report: dict = {"bundle": str(args.bundle), "tokens": args.tokens, "rounds": args.rounds}
    parts = args.part.split(",")
    if "paths" in parts:
        report["paths"] = paths(args.bundle, args.rounds, args.tokens)
        print("| path | decode tok/s | step ms | stage compute ms | beyond compute ms |\n|---|---|---|---|---|")
        for name, m in report["paths"]["median"].items():
            print(f"| {name} | {m['tokens_per_s']:.1f} | {m['step_ms']:.3f} | {m['compute_ms']:.3f} | "
                  f"{m['beyond_compute_ms']:.3f} |")
        for name, ratio in report["paths"]["over_workers"].items():
            print(f"{name} / workers (median of per-round ratios): {ratio}x")
    if "settings" in parts:
        report["settings"] = settings(args.bundle, args.rounds, args.tokens)
        print("| CPU plugin setting | ms per decode step | speed vs default |\n|---|---|---|")
        for name, m in report["settings"].items():
            print(f"| {name} | {m['step_ms']:.3f} | {m['vs_default']:.2f}x |")
    rows = [{"part": "path", "name": name, "step_ms": round(m["step_ms"], 3)}
            for name, m in report.get("paths", {}).get("median", {}).items()]
    rows += [{"part": "setting", "name": name, "step_ms": round(m["step_ms"], 3)}
             for name, m in report.get("settings", {}).items()]
    write_results("decode_overhead", rows, report, title="a decode step's profile and CPU plugin settings")
    log(f"wrote {RESULTS / 'decode_overhead.json'}")


if __name__ == "__main__":
    main()
