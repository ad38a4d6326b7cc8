#!/usr/bin/env python
"""`ovshard run --local` in process: the engine loop over the stages in this process against a decode loop of its own.

Two runtimes of one bundle in one process, both loaded as ``run --local`` loads a bundle (paged, the last stage's
logits sliced, the static decode copy, the bundle's CPU hints, ``--threads``): ``loop``, the engine
(scheduling/engine.py) over client/local_head.py's in-process link, what ``run --local`` runs; ``direct``, the
reference LocalPipeline's own decode loop (decoding/decode.py), the way ``run --local`` generated before the
engine drove the stages in process. Each round generates ``--tokens`` greedy tokens of the same prompt in both,
alternating which goes first. A sample is the decode rate as the reader sees it (tokens after the first over the
seconds from the first to the last) and what a step took beyond the stages' compute. Prints the medians, the
median of the rounds' ratios and whether the two chose the same tokens; writes ``local_loop_<first>_first.{json,md}`` under ``--out``. Which of the two is loaded
first shifted both one's speed by up to 1.5x on a shared machine: run it with each ``--load-first``.

    CI=true .venv/bin/python bench/local_loop.py BUNDLE [--threads 2] [--tokens 128] [--rounds 5] \
        [--load-first direct|loop]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULTS, interleaved, progress, write_results  # noqa: E402  (bench/ is not a package)

if TYPE_CHECKING:
    from ovshard.runtime.decoding.decode import Stats


def rate(tokens: Iterator[int], seen: list[int], stats: Stats) -> dict[str, float]:
    """Decode tokens/s of ``tokens`` as its reader sees them (from the first token to the last), and the ms a
    step took beyond the stages' compute (the loop's own cost: sampling, planning, handing tokens over)."""
    stamps = []
    for token in tokens:
        stamps.append(time.perf_counter())
        seen.append(token)
    decode = stamps[-1] - stamps[0]
    compute = sum(sum(step.values()) for step in stats.stage_s[1:len(stamps)])
    return {"tok_s": (len(stamps) - 1) / decode, "beyond_ms": 1e3 * (decode - compute) / (len(stamps) - 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens a generation (no eos stop)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--load-first", choices=("direct", "loop"), default="direct",
                    help="which of the two loads first (run both: the order shifts their speed)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.client.local_head import LocalHead
    from ovshard.runtime.client.text import Text
    from ovshard.runtime.decoding.decode import Stats
    from ovshard.runtime.engine.sampler import SamplingConfig
    from ovshard.runtime.node.config import model_cache, stage_config

    config = stage_config(False, args.threads)
    prompt = Text(args.bundle, read_manifest(args.bundle)).encode(args.prompt, None)
    sampling = SamplingConfig(max_tokens=args.tokens)
    progress(f"loading {args.bundle} twice ({args.threads} threads each)")
    load = {"direct": lambda: LocalPipeline(args.bundle, config=config, slice_logits=True,
                                            cache_dir=model_cache(None), paged=True),
            "loop": lambda: LocalHead(args.bundle, config=config, cache_dir=model_cache(None))}
    first = load[args.load_first]()  # the order the two load in shifted their speed by up to 1.5x here: run both
    second = load["loop" if args.load_first == "direct" else "direct"]()
    direct, loop = (first, second) if args.load_first == "direct" else (second, first)
    chosen: dict[str, list[list[int]]] = {"loop": [], "direct": []}

    def case(name: str, generate: Callable[[Stats], Iterator[int]]) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            chosen[name].append([])
            stats = Stats()
            return rate(generate(stats), chosen[name][-1], stats)
        return run

    def tok_s(sample: dict[str, float]) -> float:
        return sample["tok_s"]

    def beyond_ms(sample: dict[str, float]) -> float:
        return sample["beyond_ms"]

    try:
        got = interleaved({"loop": case("loop", lambda stats: loop.generate(prompt, sampling, stats)),
                           "direct": case("direct", lambda stats: direct.generate(prompt, sampling, stats))},
                          rounds=args.rounds, warmup=1, timed=False, label="tok/s",
                          show=lambda s: f"{s['tok_s']:.1f} tok/s, {s['beyond_ms']:.3f} ms beyond compute")
    finally:
        loop.close()
    same = all(a == b for a, b in zip(chosen["loop"], chosen["direct"], strict=True))
    rows = [{"case": c, "decode_tok_s": round(got.median(c, tok_s), 2),
             "x_direct": round(got.ratio(c, "direct", tok_s), 4),
             "ms_beyond_compute": round(got.median(c, beyond_ms), 3),
             "samples": [round(s, 2) for s in got.values(c, tok_s)]} for c in got.cases]
    print(write_results(f"local_loop_{args.load_first}_first", rows, {"bundle": str(args.bundle),
                                                                      "threads": args.threads,
                                                                      "load_first": args.load_first,
                                             "tokens": args.tokens, "rounds": args.rounds, "same_tokens": same},
                        out=args.out, title="run --local in process: the engine loop against a loop of its own"))
    print(f"same tokens in every round: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
