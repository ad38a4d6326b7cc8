#!/usr/bin/env python
"""A one-stage local decode step with and without the static decode copy (engine/static_step.py), interleaved.

Two ``LocalPipeline``s of one bundle in one process, as ``ovshard run --local`` loads it (paged, the last
stage's logits sliced, the bundle's CPU hints, ``--threads``): one runs its one-token steps on the static copy,
the other on the dynamic paged model. Each round prefills the same prompt of ``--context`` random ids in both,
then runs ``--steps`` greedy decode steps, the two pipelines alternating step by step (the first of each pair
alternating too), each timed alone through ``LocalPipeline.step``. Prints the medians, their ratio and whether
the two chose the same tokens; writes ``static_decode.{json,md}`` under ``--out``.

    CI=true .venv/bin/python bench/static_decode.py BUNDLE [--threads 2] [--context 64] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import write_results  # noqa: E402  (bench/ is not a package)


def rss_mib() -> float:
    """This process's peak resident memory so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    from ovshard.runtime.client.inprocess import LocalPipeline

    config = {"INFERENCE_NUM_THREADS": str(args.threads)}
    pipes, memory = {}, {}
    for label, static in (("dynamic", False), ("static", True)):
        before = rss_mib()
        start = time.perf_counter()
        pipes[label] = LocalPipeline(args.bundle, config=config, slice_logits=True, paged=True, static_decode=static,
                                     verify=False)
        memory[label] = (rss_mib() - before, time.perf_counter() - start)
        print(f"{label}: loaded in {memory[label][1]:.1f} s, peak RSS +{memory[label][0]:.0f} MiB", file=sys.stderr)
    vocab = pipes["dynamic"].vocab_size
    times: dict[str, list[float]] = {label: [] for label in pipes}
    same = True
    for r in range(args.rounds):
        prompt = np.random.default_rng(r).integers(0, vocab, args.context).tolist()
        last = {label: p.step(prompt, 0, "argmax").argmax(-1) for label, p in pipes.items()}
        for i in range(args.steps):
            order = list(pipes) if (r + i) % 2 == 0 else list(reversed(pipes))
            for label in order:
                start = time.perf_counter()
                scores = pipes[label].step([last[label]], args.context + i, "argmax")
                times[label].append(time.perf_counter() - start)
                last[label] = scores.argmax(-1)
            same &= last["dynamic"] == last["static"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    ratio = ms["dynamic"] / ms["static"]
    rows = [{"decode step": label, "median ms": round(ms[label], 3), "load s": round(memory[label][1], 1),
             "peak RSS added MiB": round(memory[label][0])} for label in pipes]
    print(f"dynamic {ms['dynamic']:.3f} ms, static {ms['static']:.3f} ms a step: {ratio:.3f}x; same tokens: {same}")
    print(write_results("static_decode", rows, {"bundle": str(args.bundle), "threads": args.threads,
                                                "steps": args.steps * args.rounds, "ratio": round(ratio, 3),
                                                "same tokens": same},
                        out=args.out, title="a one-stage decode step, dynamic paged model against its static copy"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
