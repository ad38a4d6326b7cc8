"""Does a step of several tokens score each row as one-token steps do? Per CPU plugin hint set.

Greedy speculation equals plain greedy only when the verify step's rows equal what one-token steps give.
On the real Gemma 3 270M's default compile (or ``--bundle``): a 12-token prompt, then 9 more tokens as one
step against 9 one-token steps from the same cache, for the CPU defaults and each hint that changes the
kernels (KV cache precision, f32 compute, dynamic quantization off). Reported: the largest logit
difference, whether every row's argmax agrees, and a one-token decode step's time (single run: a rough
guide, timings drift here).

    CI=true .venv/bin/python bench/batching/batch_rows.py [--bundle BUNDLE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import RESULTS, write_results  # noqa: E402  (bench/ is not a package)

PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 236743, 3648, 529, 4104, 6861]
MORE = [563, 138, 236764, 2793, 496, 108, 3022, 529, 573]
HINTS = {
    "CPU defaults": {},
    "KV cache f16": {"KV_CACHE_PRECISION": "f16"},
    "dynamic quantization off": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "f32 compute + f32 KV (the old --exact)": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
    "--exact (f32, f32 KV, dynamic quantization off)": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                                        "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
}


def default_bundle() -> Path:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from real_gemma import gemma_gguf_path

    out = Path("/tmp/ovshard-bench/bundles/gemma3-270m-1st-default")
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(gemma_gguf_path()), "-o", str(out),
                        "--max-positions", "1024"], check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import openvino as ov

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.stage import Stage

    bundle = args.bundle or default_bundle()
    manifest, core, rows = read_manifest(bundle), ov.Core(), []
    for name, hints in HINTS.items():
        stage = Stage(bundle, manifest, 0, core, config=hints)
        stage.step(np.array([PROMPT]), 0)
        batched = stage.step(np.array([MORE]), len(PROMPT))[0]
        stage.reset()
        stage.step(np.array([PROMPT]), 0)
        single = np.stack([stage.step(np.array([[t]]), len(PROMPT) + i)[0, 0] for i, t in enumerate(MORE)])
        stage.reset()
        stage.step(np.array([PROMPT]), 0)
        began = time.perf_counter()
        for i in range(32):
            stage.step(np.array([[MORE[i % len(MORE)]]]), len(PROMPT) + i)
        rows.append({"hints": name, "max_logit_diff": float(np.abs(batched - single).max()),
                     "argmax_equal": bool((batched.argmax(-1) == single.argmax(-1)).all()),
                     "decode_ms": round((time.perf_counter() - began) / 32 * 1000, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(write_results("batch_rows", rows, {"bundle": str(bundle)}, out=args.out,
                        title="a 9-token step's rows against 9 one-token steps, per hint set"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
