#!/usr/bin/env python
"""The fixed cost of a compile: stories260K (5 layers, 260K parameters) in 2 stages, default and fp32, in-process.

On a model this small nothing is spent on the weights: what is measured is the compiler's own overhead per
piece (tracing, passes, NNCF's setup, saving, garbage collection), which every layer of a big model pays too.
Each round compiles both formats into a fresh folder with the layer cache off; the first round includes the
one-time imports and is reported apart. Compare two commits by running this on each, interleaved
(``git stash`` / ``git checkout``), on a quiet machine.

    CI=true .venv/bin/python bench/compile_overhead.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=STORIES)
    args = parser.parse_args(argv)
    formats = {"default": WeightFormat(), "fp32": WeightFormat("fp32")}
    seconds: dict[str, list[float]] = {name: [] for name in formats}
    with tempfile.TemporaryDirectory(prefix="ovshard-overhead-") as tmp:
        for r in range(args.rounds + 1):
            for name, weights in formats.items():
                out = Path(tmp) / f"{name}{r}"
                start = time.perf_counter()
                compile_bundle(CompileConfig(args.checkpoint, out, stages=2, weights=weights, cache_dir=None))
                seconds[name].append(time.perf_counter() - start)
                shutil.rmtree(out)
            print(f"round {r} of {args.rounds} (0: first, with the imports)", file=sys.stderr)
    result = {name: {"first_s": round(s[0], 2), "median_s": round(statistics.median(s[1:]), 2)}
              for name, s in seconds.items()}
    print(json.dumps({"checkpoint": str(args.checkpoint), "stages": 2, "rounds": args.rounds, "compiles": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
