"""A calibrated layer's own work with nothing beside it: its weights loaded, its float32 run, its scale fits.

Times, for one layer of a checkpoint at each torch thread count given, the parts a calibrated compile adds to a
data-free layer (``ovshard/frontend/calibration.py``, ``int4_fit.py``), each run alone in this process: so the
compile's own figures (``layer_clock.py``, where they run beside the conversion) can be told apart from what
the parts cost by themselves. Prints a table to stderr and JSON to stdout.

    CI=true .venv/bin/python bench/compile/calib_alone.py CKPT --layer 1 --threads 2,8,16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ovshard.bundle.stage import StageSpec
from ovshard.bundle.weights import WeightFormat
from ovshard.compile_config import CompileConfig
from ovshard.frontend import int4_fit
from ovshard.frontend.calibration import Activations, calibration_text
from ovshard.frontend.checkpoint import open_checkpoint
from ovshard.frontend.trace import load_layer
from ovshard.memory import return_freed_blocks


def _clock(fn, *args):  # -> (result, seconds)
    began = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--threads", default="2", help="torch thread counts, comma-separated")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=CompileConfig.calibration_samples,
                        help="calibration samples (the compile's default)")
    args = parser.parse_args()
    return_freed_blocks()  # the compile's allocator setting
    ckpt = open_checkpoint(args.checkpoint)
    spec = StageSpec(0, 1, 0, ckpt.dims.num_layers)
    fmt = WeightFormat(group_size=args.group)
    with tempfile.TemporaryDirectory(prefix="ovshard-calib-alone-") as tmp:
        text = calibration_text(ckpt, "text", args.samples, CompileConfig.calibration_tokens, Path(tmp))
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for rnd in range(args.rounds):
            acts = Activations(ckpt, text)
            acts._move_to(args.layer)
            held, load_s = _clock(load_layer, ckpt, args.layer, spec)
            acts.lend(args.layer, [held])
            _, forward_s = _clock(acts.catch, args.layer)
            fit_s = moments_s = 0.0
            weights, seen = 0, {}
            for name, tensor in held.named_buffers():
                projection = name.removesuffix("_weight")
                if name == projection or tensor.dim() != 2 or projection not in acts.caught:
                    continue
                group = fmt.group_for(tensor.shape[-1])  # the compile's group (NNCF's fallback where it does not fit)
                if group is None:  # stored INT8: never fitted
                    continue
                inputs = acts.caught[projection]
                if id(inputs) not in seen:  # q, k and v (gate and up) share their inputs' moments, as in the compile
                    seen[id(inputs)], s = _clock(int4_fit.second_moments, inputs, group)
                    moments_s += s
                moments = seen[id(inputs)]
                _, s = _clock(int4_fit.fit, tensor, moments)
                fit_s += s
                weights += tensor.numel()
            row = {"threads": threads, "round": rnd + 1, "load_s": round(load_s, 3), "forward_s": round(forward_s, 3),
                   "moments_s": round(moments_s, 3), "fit_s": round(fit_s, 3),
                   "fit_ns_a_weight": round(1e9 * fit_s / max(weights, 1), 2)}
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)
    print(json.dumps({"checkpoint": str(args.checkpoint), "layer": args.layer, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
