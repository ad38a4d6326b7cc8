"""What the default (calibrated) INT4 compile costs against the data-free one, per layer: seconds and peak memory.

A random-weight checkpoint of a real shape (``ovshard synth``, the Llama-3.2-1B shape by default, a few layers)
gets stories260K's tokenizer files, so that the shipped calibration text can be tokenized (random weights say
nothing about accuracy: ``bench/int4_frontier.py`` measures that on real models). Then ``ovshard compile --json``
runs in a child process of its own, alternately with ``--calibration none`` (A) and the default (B), ``--rounds``
times each, A and B interleaved so that both see the same load; each child reports its seconds a layer (the layer
pieces alone) and its peak RSS. ``--budget 1.0`` by default: every decoder weight INT4, so every one is fitted (the
default budget on a short stack keeps most of them INT8, which costs nothing to fit).

    .venv/bin/python bench/int4_fit_cost.py [--shape llama-3.2-1b] [--layers 4] [--rounds 3] [--budget 1.0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STORIES = HERE.parents[1] / "shared" / "models" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
CLI = [sys.executable, "-m", "ovshard.cli"]


def compile_once(ckpt: Path, out: Path, calibration: str, budget: str) -> dict:
    done = subprocess.run([*CLI, "-q", "compile", str(ckpt), "-o", str(out), "--no-cache", "--max-positions", "1024",
                           "--budget", budget, "--calibration", calibration, "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compile --calibration {calibration} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", default="1.0")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"none": [], "default": []}
    with tempfile.TemporaryDirectory(prefix="ovshard-fit-cost-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        subprocess.run([*CLI, "-q", "synth", args.shape, "--layers", str(args.layers), "-o", str(ckpt)], check=True,
                       stdout=subprocess.DEVNULL)
        for name in TOKENIZER_FILES:
            shutil.copy(STORIES / name, ckpt / name)
        for r in range(args.rounds):
            for calibration in ("none", "default"):  # A, B interleaved
                found = compile_once(ckpt, Path(tmp) / "out", calibration, args.budget)
                runs[calibration].append(found)
                print(f"round {r + 1}: --calibration {calibration}: {found['seconds_per_layer']} s a layer, peak RSS "
                      f"{found['peak_rss_bytes'] / 2**20:.0f} MiB, {found['seconds']} s in all", file=sys.stderr,
                      flush=True)
    per_layer = {k: [r["seconds_per_layer"] for r in v] for k, v in runs.items()}
    ratios = [b / a for a, b in zip(per_layer["none"], per_layer["default"], strict=True)]
    peaks = [b["peak_rss_bytes"] / a["peak_rss_bytes"] for a, b in zip(runs["none"], runs["default"], strict=True)]
    result = {"shape": args.shape, "layers": args.layers, "budget": args.budget, "seconds_per_layer": per_layer,
              "time_ratio_per_round": [round(x, 3) for x in ratios], "time_ratio_median": round(statistics.median(ratios), 3),
              "peak_rss_ratio_per_round": [round(x, 3) for x in peaks], "weights": runs["default"][0]["weights"]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
