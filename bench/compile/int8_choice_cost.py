"""Cost of the compiler's whole-model INT8 choice alone (``ovshard.plan.precision.choose_int8``) on a checkpoint.

    CI=true .venv/bin/ovshard synth llama-3.2-1b -o /tmp/l1b --dtype bfloat16
    CI=true .venv/bin/python bench/compile/int8_choice_cost.py /tmp/l1b

Prints the figures; writes bench/results/int8_choice_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.weights import WeightFormat  # noqa: E402
from ovshard.frontend.source import open_source  # noqa: E402
from ovshard.plan.precision import choose_int8  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    args = parser.parse_args()
    checkpoint = open_source(args.checkpoint)
    began = time.perf_counter()
    chosen = choose_int8(checkpoint, WeightFormat())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = time.perf_counter() - began
    print(f"choose_int8: {seconds:.1f} s, {len(chosen)} decoder weights INT8, process peak RSS {peak_mb:.0f} MB")
    write_results("int8_choice_cost", [{"checkpoint": str(args.checkpoint), "s": round(seconds, 1),
                                        "int8_weights": len(chosen), "peak_rss_mb": round(peak_mb)}],
                  title="the whole-model INT8 choice alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
