"""A fork from one thread while another multiplies in numpy's OpenBLAS: the hang that telemetry forks caused.

OpenVINO's converter and NNCF send each telemetry event from a thread of their pool through a forked child
(``openvino_telemetry``'s GA4 backend), and OpenBLAS shuts its thread pool down in a ``pthread_atfork`` handler.
Here one thread forks (``multiprocessing.Process``, as the telemetry does) in a loop while another runs ``a @ a``
on numpy's default BLAS threads; each trial is a child process of its own, watched for ``--seconds``: a trial in
which the matmuls stop advancing for 2 s is counted as hung, and killed. With ``--blas-threads 1`` (what a compile
sets, ``ovshard/watchdog.py``) OpenBLAS never hands work to its pool. Prints a JSON summary.

    .venv/bin/python bench/compile/fork_beside_blas.py [--trials 5] [--seconds 10] [--blas-threads 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_TRIAL = """
import multiprocessing, sys, threading, time
import numpy as np
from threadpoolctl import threadpool_limits
if int(sys.argv[2]):
    threadpool_limits(int(sys.argv[2]), user_api="blas")
a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
count, forks = [0], [0]
def fork():
    while True:
        p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
        p.start(); p.join(); forks[0] += 1
def multiply():
    while True:
        a @ a; count[0] += 1
threading.Thread(target=fork, daemon=True).start()
threading.Thread(target=multiply, daemon=True).start()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    seen = count[0]; time.sleep(2)
    if count[0] == seen:
        print("hung", seen, forks[0], flush=True); sys.exit(0)
print("ran", count[0], forks[0], flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--blas-threads", type=int, default=0, help="0: numpy's default")
    args = parser.parse_args()
    trials = []
    for _ in range(args.trials):
        try:
            done = subprocess.run([sys.executable, "-c", _TRIAL, str(args.seconds), str(args.blas_threads)],
                                  capture_output=True, text=True, timeout=args.seconds + 30)
            words = done.stdout.split()
        except subprocess.TimeoutExpired:  # even the watching thread never ran again: hung
            words = ["hung", "?", "?"]
        trials.append({"outcome": words[0] if words else "failed", "matmuls": words[1:2], "forks": words[2:3]})
        print(trials[-1], file=sys.stderr, flush=True)
    print(json.dumps({"blas_threads": args.blas_threads or "default", "seconds": args.seconds,
                      "hung": sum(t["outcome"] == "hung" for t in trials), "trials": trials}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
