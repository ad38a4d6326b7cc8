#!/usr/bin/env python
"""`ovshard api --local` and `ovshard chat --local` on a one-stage bundle: the stage in the command's own process
against a worker process (``--workers``), decode tokens/s, rounds alternating.

api   one server a side per round (``--threads T``, ``--model x``); after a warm-up, each of ``--users`` clients at
      once asks ``--tokens`` greedy tokens of a prompt of its own (non-streamed); a sample is the new tokens over
      the wall seconds of all of them; with one client the first token's time (a 1-token request) is taken off.
chat  ``printf 'PROMPT\\n/stats\\n' | ovshard chat BUNDLE --local --max-tokens N --speculative off
      --temperature 0``: its ``decode_tokens_per_s``.

Prints each round and the median of the rounds' ratios (in-process over workers).

    CI=true .venv/bin/python bench/api/placement.py BUNDLE [--mode api|chat] [--users 1] [--tokens 128]
        [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CLI = [sys.executable, "-m", "ovshard.cli", "-q"]
PROMPTS = ["Once upon a time, in a small village by the sea, there lived", "The history of the Roman empire begins",
           "def fibonacci(n):", "My favourite recipe for bread is", "In the year 2050, cities will",
           "The cat sat on the mat and", "Dear John, I am writing to tell you", "The best way to learn a language is"]
SIDES = {"in-process": [], "workers": ["--workers"]}


def api_rate(bundle: str, extra: list[str], users: int, tokens: int, threads: int) -> float:
    import openai

    server = subprocess.Popen([*CLI, "api", bundle, "--local", "--threads", str(threads), "--listen", "127.0.0.1:0",
                               "--model", "x", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        client = openai.OpenAI(base_url=f"http://{json.loads(server.stdout.readline())['api']}/v1", api_key="none",
                               max_retries=0, timeout=600)

        def ask(i: int, n: int = tokens) -> int:
            answer = client.completions.create(model="x", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=n,
                                               temperature=0)
            assert answer.usage is not None
            return answer.usage.completion_tokens

        with ThreadPoolExecutor(users) as pool:
            list(pool.map(ask, range(users)))  # warm-up: the prompts' blocks and the plugin's first runs
            first = 0.0
            if users == 1:
                start = time.perf_counter()
                ask(0, 1)
                first = time.perf_counter() - start
            start = time.perf_counter()
            made = sum(pool.map(ask, range(users)))
            seconds = time.perf_counter() - start
            if users == 1 and made > 1 and seconds > first:  # the tokens after the first, over their own time
                return (made - 1) / (seconds - first)
            return made / seconds
    finally:
        server.terminate()
        server.wait(30)


def chat_rate(bundle: str, extra: list[str], tokens: int, threads: int) -> float:
    done = subprocess.run([*CLI, "chat", bundle, "--local", "--threads", str(threads), "--max-tokens", str(tokens),
                           "--speculative", "off", "--temperature", "0", *extra],
                          input="Tell me a long story about a cat.\n/stats\n", capture_output=True, text=True,
                          timeout=600, check=True)
    found = re.findall(r"decode_tokens_per_s=([0-9.]+)", done.stdout)
    if not found:
        raise SystemExit(f"no /stats line in chat's output: {done.stdout[-500:]} {done.stderr[-500:]}")
    return float(found[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--mode", choices=("api", "chat"), default="api")
    ap.add_argument("--users", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ratios = []
    for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
        got = {}
        for side in order:
            if args.mode == "api":
                got[side] = api_rate(args.bundle, SIDES[side], args.users, args.tokens, args.threads)
            else:
                got[side] = chat_rate(args.bundle, SIDES[side], args.tokens, args.threads)
        ratios.append(got["in-process"] / got["workers"])
        print(f"round {r}: in-process {got['in-process']:.1f} tok/s, workers {got['workers']:.1f} tok/s, "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"median ratio (in-process / workers): {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
