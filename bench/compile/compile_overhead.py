#!/usr/bin/env python
"""The fixed cost of a compile: stories260K (5 layers, 260K parameters) in 2 stages, default and fp32, in-process.

On a model this small nothing is spent on the weights: what is measured is the compiler's own overhead per
piece (tracing, passes, NNCF's setup, saving, garbage collection), which every layer of a big model pays too.
Each round compiles both formats into a fresh folder with the layer cache off; the first round includes the
one-time imports and is reported apart. Compare two commits by running this on each, interleaved
(``git stash`` / ``git checkout``), on a quiet machine.

    CI=true .venv/bin/python bench/compile/compile_overhead.py [--rounds 3]

Writes bench/results/compile_overhead.{json,md} (bench/harness.py) and prints the table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import STORIES, interleaved, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.weights import WeightFormat  # noqa: E402
from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=STORIES)
    args = parser.parse_args(argv)
    formats = {"default": WeightFormat(), "fp32": WeightFormat("fp32")}
    with tempfile.TemporaryDirectory(prefix="ovshard-overhead-") as tmp:
        done = iter(range(10**9))

        def compile_once(weights: WeightFormat) -> None:
            out = Path(tmp) / f"piece{next(done)}"
            compile_bundle(CompileConfig(args.checkpoint, out, stages=2, weights=weights, cache_dir=None))
            shutil.rmtree(out)

        # round 1 carries the one-time imports: reported apart from the median of the others
        got = interleaved({name: lambda w=w: compile_once(w) for name, w in formats.items()}, args.rounds + 1,
                          label="s a compile")
    rows = [{"format": name, "first_s": round(s[0], 2), "median_s": round(statistics.median(s[1:]), 2),
             "samples_s": [round(v, 3) for v in s]} for name, s in got.samples.items()]
    meta = {"checkpoint": str(args.checkpoint), "stages": 2, "rounds": args.rounds}
    print(write_results("compile_overhead", rows, meta, title="the compiler's fixed cost: stories260K, 2 stages"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
