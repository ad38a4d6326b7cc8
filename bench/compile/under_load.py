"""The default compile of a real model, many times in a row, with every core held by numpy's matmuls: each must end.

Run as a user runs it: no ``CI`` variable, so OpenVINO's and NNCF's telemetry is on unless the compile declines
it (``ovshard/watchdog.py``), and the user's own home. ``--load`` other processes multiply 512x512 matrices in
numpy (OpenBLAS on its default threads) for the whole run. Each compile is a fresh ``ovshard compile`` process
with ``--no-cache``; one that runs past ``--timeout`` seconds is killed and counted as stalled (its stderr, with
the watchdog's report if it said anything, is kept). Prints one line a compile to stderr and a JSON summary.

    .venv/bin/python bench/compile/under_load.py MODEL [--runs 10] [--stages 2] [--load 2] [--timeout 1200]

``bench/compile/fork_beside_blas.py`` shows the hang this guards against, in a few seconds, without ovshard.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spin() -> None:
    import numpy as np

    a = np.random.default_rng(0).standard_normal((512, 512))
    while True:
        a = np.tanh(a @ a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder or GGUF file, as `ovshard compile` takes it")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy numpy processes beside it")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before a compile counts as stalled")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI", "NNCF_DEV")}
    loaders = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in loaders:
        p.start()
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="ovshard-under-load-") as tmp:
            for n in range(args.runs):
                out, began = Path(tmp) / "bundle", time.monotonic()
                try:
                    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "compile", args.model, "-o", str(out),
                                           "--stages", str(args.stages), "--no-cache"], env=env, capture_output=True,
                                          text=True, timeout=args.timeout)
                    code, err = done.returncode, done.stderr
                except subprocess.TimeoutExpired as e:
                    code = None  # stalled: keep what it said, the watchdog's report among it
                    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
                seconds = round(time.monotonic() - began, 1)
                watchdog = "no progress for" in err
                runs.append({"run": n + 1, "seconds": seconds, "returncode": code, "watchdog_spoke": watchdog})
                print(f"run {n + 1}: {'stalled' if code is None else f'rc {code}'} in {seconds} s"
                      f"{', the watchdog spoke' if watchdog else ''}", file=sys.stderr, flush=True)
                if code != 0:
                    print(err[-4000:], file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        for p in loaders:
            p.kill()
    finished = [r for r in runs if r["returncode"] == 0]
    print(json.dumps({"model": args.model, "stages": args.stages, "load": args.load, "runs": runs,
                      "finished": len(finished), "stalled": sum(r["returncode"] is None for r in runs),
                      "seconds": [r["seconds"] for r in finished]}, indent=2))
    return 0 if len(finished) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
