#!/usr/bin/env python
"""A crowd against `ovshard api --local`: N streaming `openai` clients released at once, every 4th going away
after 3 chunks, against the server's defaults (or the `ovshard api` options after ``--``).

Prints one JSON object: requests kept, completed (finish reason stop or length), dropped and refused (429,
with the Retry-After values seen), the median and slowest latency of the kept ones (request sent -> last
chunk), the KV blocks in use and requests running or waiting once the crowd is over, and each process's RSS
(the API process, then its workers) after a warm-up of 8 clients and after the crowd (``--crowds N``: after
each of N crowds in a row, the last one measured).

    .venv/bin/python bench/api/api_crowd.py BUNDLE                          # the defaults
    .venv/bin/python bench/api/api_crowd.py BUNDLE --crowds 3               # memory after each of 3 crowds
    .venv/bin/python bench/api/api_crowd.py BUNDLE -- --streams 4 --queue 16  # user-set limits
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("CI", "true")  # before openvino loads: no telemetry forks, also in the child processes
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import openai  # noqa: E402
import psutil  # noqa: E402
from api_server import Api, api, idle, until  # noqa: E402
from conftest import at_once  # noqa: E402

PROMPTS = ["Once upon a time", "The cat", "Lily saw", "One day", "Tom had a", "The sun"]


def client_run(server: Api, model: str, tokens: int, i: int) -> tuple[str, float, int | None]:
    """Client ``i``: (finish reason, "dropped" or "429"; seconds; the Retry-After of a 429)."""
    start = time.perf_counter()
    try:
        stream = server.client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=tokens,
                                                  temperature=0, stream=True)
        finish = "none"
        for n, chunk in enumerate(stream, 1):
            if i % 4 == 3 and n == 3:
                stream.close()
                return "dropped", time.perf_counter() - start, None
            finish = chunk.choices[0].finish_reason or finish
        return finish, time.perf_counter() - start, None
    except openai.RateLimitError as e:
        return "429", time.perf_counter() - start, int(e.response.headers.get("retry-after", -1))


def rss_mb(pid: int) -> list[int]:
    head = psutil.Process(pid)
    return [p.memory_info().rss >> 20 for p in (head, *head.children())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--crowds", type=int, default=1, help="crowds in a row against the same server; each one's "
                        "memory after it is reported (a leak grows with every crowd, a batch's buffers once)")
    parser.add_argument("options", nargs="*", help="`ovshard api` options, after --")
    args = parser.parse_args()
    model = args.bundle.resolve().name
    with api(args.bundle, *args.options, local=True) as server:

        def crowd(clients: int) -> list:
            return at_once(lambda i: client_run(server, model, args.tokens, i), list(range(clients)), 300)

        crowd(8)
        warm = rss_mb(server.process.pid)
        later = []
        for _ in range(args.crowds - 1):  # the first crowds: only their memory after them is kept
            crowd(args.clients)
            until(idle, server.url)
            later.append(rss_mb(server.process.pid))
        start = time.perf_counter()
        results = crowd(args.clients)
        wall = time.perf_counter() - start
        after = until(idle, server.url)
        kept = [seconds for finish, seconds, _ in results if finish not in ("dropped", "429")]
        report = {
            "clients": args.clients, "tokens": args.tokens, "options": args.options, "wall_s": round(wall, 2),
            "outcomes": Counter(finish for finish, _, _ in results),
            "completed": sum(finish in ("stop", "length") for finish, _, _ in results),
            "retry_after_s": sorted({r for _, _, r in results if r is not None}),
            "median_s": round(statistics.median(kept), 3) if kept else None,
            "slowest_s": round(max(kept), 3) if kept else None,
            "after": {k: after[k] for k in ("ovshard_kv_blocks{state=used}", "ovshard_active_streams",
                                            "ovshard_queue_depth", "ovshard_batch_sequences{state=running}",
                                            "ovshard_batch_sequences{state=waiting}")},
            "rss_mb_warm": warm, "rss_mb_after_earlier_crowds": later, "rss_mb_after": rss_mb(server.process.pid),
        }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
