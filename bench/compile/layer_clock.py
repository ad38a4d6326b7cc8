"""Where a compile's time goes, part by part: wall seconds in each, on the compile's thread and on the others.

Runs ``ovshard compile`` in this process with a clock around the parts a layer piece goes through (loading its
weights, the trace and conversion to OpenVINO, the passes, NNCF, the calibration's float32 run, the scale fit,
packing the INT4 codes, waiting for the fit-ahead thread, writing the piece), each summed per thread kind: ``main``
(the compile's thread) and ``other`` (the fit-ahead thread, ``ovshard/frontend/fit_ahead.py``). Parts nest (a fit
inside the passes), so the column does not add up to the total. Prints a table to stderr and JSON to stdout.

    CI=true .venv/bin/python bench/compile/layer_clock.py CKPT [compile options, e.g. --budget 1.0 --calibration none]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ovshard import layerwise
from ovshard.frontend import calibration, fit_ahead, int4_fit, pieces
from ovshard.passes import compress_weights

SECONDS: dict[tuple[str, str], float] = collections.defaultdict(float)


def _clocked(owner: Any, name: str, part: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(inner)
    def clocked(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            where = "main" if threading.current_thread() is threading.main_thread() else "other"
            SECONDS[(part, where)] += time.perf_counter() - began

    setattr(owner, name, clocked)


PARTS = [(layerwise, "_trace_layers", "layer piece: weights loaded and traced to OpenVINO"),
         (layerwise, "load_layer", "  of it: a layer's weights loaded (float32)"),
         (pieces, "layers_piece", "  of it: the torch module converted"),
         (layerwise, "_run_layer_passes", "layer piece: the passes"),
         (compress_weights.CompressWeightsPass, "_fit", "  of it: the fitted weights (waiting and packing)"),
         (compress_weights, "int4_weight", "    of it: the INT4 codes packed"),
         (fit_ahead.FitAhead, "_settle", "    of it: waiting for the fit-ahead thread"),
         (layerwise, "_persist", "layer piece: written and read back"),
         (calibration.Activations, "catch", "calibration: a layer's float32 run, its inputs kept"),
         (int4_fit, "second_moments", "calibration: second moments"),
         (int4_fit, "fit", "calibration: the scale fit")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Other options go to `ovshard compile` as they are.")
    parser.add_argument("checkpoint", help="what `ovshard compile` takes: a checkpoint folder, a GGUF file")
    args, options = parser.parse_known_args()
    for owner, name, part in PARTS:
        _clocked(owner, name, part)
    import nncf

    _clocked(nncf, "compress_weights", "NNCF compress_weights")
    from ovshard import cli

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ovshard-layer-clock-") as tmp:
        code = cli.main(["-q", "compile", args.checkpoint, "-o", f"{tmp}/bundle", "--no-cache", "--json", *options])
    total = time.perf_counter() - began
    names = [part for _, _, part in PARTS] + ["NNCF compress_weights"]
    rows = [(part, round(SECONDS.get((part, "main"), 0.0), 2), round(SECONDS.get((part, "other"), 0.0), 2))
            for part in names]
    width = max(len(r[0]) for r in rows)
    print(f"{'part':<{width}}  main s  other s", file=sys.stderr)
    for part, main_s, other_s in rows:
        print(f"{part:<{width}}  {main_s:>6}  {other_s:>7}", file=sys.stderr)
    print(f"{'the whole compile':<{width}}  {total:>6.2f}", file=sys.stderr)
    print(json.dumps({"returncode": code, "seconds": round(total, 2),
                      "parts": [{"part": p.strip(), "main_s": m, "other_s": o} for p, m, o in rows]}))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
