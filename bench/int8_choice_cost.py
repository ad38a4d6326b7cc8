"""Cost of the compiler's whole-model INT8 choice alone (``ovshard.plan.precision.choose_int8``) on a checkpoint.

    CI=true .venv/bin/ovshard synth llama-3.2-1b -o /tmp/l1b --dtype bfloat16
    CI=true .venv/bin/python bench/int8_choice_cost.py /tmp/l1b
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from ovshard.bundle.weights import WeightFormat
from ovshard.frontend.source import open_source
from ovshard.plan.precision import choose_int8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    args = parser.parse_args()
    checkpoint = open_source(args.checkpoint)
    began = time.perf_counter()
    chosen = choose_int8(checkpoint, WeightFormat())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"choose_int8: {time.perf_counter() - began:.1f} s, {len(chosen)} decoder weights INT8, "
          f"process peak RSS {peak_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
