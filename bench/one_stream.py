#!/usr/bin/env python
"""One stream alone through worker processes: paged stages with their static decode copy, paged without it
(``serve --no-static-decode``), and stateful stages, interleaved round by round in one process.

Each layout is a set of ``ovshard serve`` processes on loopback (one per stage, ``--threads`` each, the
bundle's own CPU hints), all started before the first round and driven by a Head of their own (the paged
ones batch, here one row a tick; the stateful ones step a stream). A round runs one greedy request of
``--tokens`` new tokens on each layout, the first layout rotating; its sample is the decode rate, the tokens
after the first over the seconds after the first. Prints the medians, each layout's ratio to the stateful
one and to the paged one without the copy (medians of the rounds' ratios), and whether each layout chose the
stateful layout's tokens and the dynamic paged one's; writes ``one_stream.{json,md}`` under ``bench/results``.

    CI=true .venv/bin/python bench/one_stream.py BUNDLE [BUNDLE ...] [--threads 1] [--tokens 128] [--rounds 3]
    CI=true .venv/bin/python bench/one_stream.py --models stories260K      # the suite's 2-stage bundle of it
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import interleaved, progress, write_results  # noqa: E402  (bench/ is not a package)

LAYOUTS = {"paged, static copy": ("auto", True), "paged, dynamic": ("auto", False), "stateful": ("stateful", True)}
PROMPTS = {"stories260K": [1, 403, 407, 261, 378], "smollm2": [6403, 1980, 253, 655]}  # peers.py's, by bundle name


def _prompt(bundle: Path, ids: str) -> list[int]:
    if ids:
        return [int(i) for i in ids.split(",")]
    for name, prompt in PROMPTS.items():
        if name.lower() in bundle.name.lower():
            return prompt
    raise SystemExit(f"{bundle}: no prompt known for this bundle's name (expected one of {sorted(PROMPTS)} in "
                     "it); pass --prompt-ids")


def _decode_rate(head: object, prompt: list[int], tokens: int, seen: list[list[int]]) -> float:
    """One greedy request's decode rate (tokens after the first / seconds after the first); its tokens go to ``seen``."""
    from ovshard.runtime.engine.sampler import SamplingConfig

    got, first = [], 0.0
    for token in head.generate(prompt, SamplingConfig(max_tokens=tokens)):  # type: ignore[attr-defined]
        got.append(token)
        if len(got) == 1:
            first = time.perf_counter()
    seen.append(got)
    return (len(got) - 1) / (time.perf_counter() - first)


def measure(bundle: Path, threads: int, tokens: int, rounds: int, ids: str = "") -> list[dict[str, object]]:
    from ovshard.runtime.client.head import Head
    from ovshard.runtime.client.launch import local_workers

    prompt = _prompt(bundle, ids)
    seen: dict[str, list[list[int]]] = {name: [] for name in LAYOUTS}
    with ExitStack() as stack:
        cases = {}
        for name, (kv, static) in LAYOUTS.items():
            progress(f"{bundle.name}: starting the {name} workers")
            addresses = stack.enter_context(local_workers(bundle, threads=threads, kv=kv, static_decode=static))
            head = Head(bundle, addresses, timeout=600)
            stack.callback(head.close)
            cases[name] = (lambda h=head, n=name: _decode_rate(h, prompt, tokens, seen[n]))
        got = interleaved(cases, rounds, warmup=1, label=bundle.name, timed=False, show=lambda s: f"{s:.1f} tok/s")
    reference = seen["stateful"]
    return [{"bundle": bundle.name, "layout": name, "threads_per_stage": threads, "tokens": tokens,
             "tok_s": round(got.median(name), 2), "x_stateful": round(got.ratio(name, "stateful"), 3),
             "x_paged_dynamic": round(got.ratio(name, "paged, dynamic"), 3),
             "same_tokens_as_stateful": seen[name] == reference,
             "same_tokens_as_paged_dynamic": seen[name] == seen["paged, dynamic"]} for name in LAYOUTS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", type=Path, nargs="*", help="compiled bundles (any number of stages)")
    ap.add_argument("--models", default="", help="comma-separated bench models (scenarios_base.MODELS), each "
                    "compiled into 2 stages as the suite's scenarios compile it (cached)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per stage worker (default 1)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request (default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-ids", default="", help="comma-separated prompt ids (default: by the bundle's name)")
    args = ap.parse_args()
    bundles = list(args.bundles)
    if args.models:
        from scenarios_base import DEFAULT_CACHE, MODELS, Bench, Settings

        unknown = [m for m in args.models.split(",") if m not in MODELS]
        if unknown:
            ap.error(f"--models {unknown}: expected names from {sorted(MODELS)}")
        bench = Bench(Settings(tuple(args.models.split(",")), args.rounds, 1, DEFAULT_CACHE, HERE / "results"))
        bundles += [bench.bundle(model, 2) for model in bench.models]
    if not bundles:
        ap.error("expected at least one bundle or --models")
    rows = [row for bundle in bundles for row in measure(bundle, args.threads, args.tokens, args.rounds,
                                                                args.prompt_ids)]
    print(write_results("one_stream", rows, {"rounds": args.rounds, "threads_per_stage": args.threads,
                                             "tokens": args.tokens, "sample": "decode tok/s of one greedy request"},
                        title="one stream alone through workers: paged with and without the static copy, stateful"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
