"""Time to the first token of a whole process, cold and warm: ovshard against llama.cpp.

Each side is a fresh process that loads the model, reads a short prompt and prints one token, timed from
launch to exit: ``ovshard run --local [--in-process] --max-tokens 1`` on the default compile and llama.cpp's
``llama-completion -n 1`` on the GGUF it was compiled from (built by bench/peers.py). **Cold**: the page
cache dropped (``/proc/sys/vm/drop_caches``, needs root; skipped with a note otherwise) and, for ovshard, an
empty compiled-model cache; **warm**: the same run again, files in the page cache and ovshard's compiled
model in its cache. Rounds alternate the order of the sides; reported: medians and ovshard / llama.cpp.

    .venv/bin/python bench/against_llama_cpp/ttft.py [--model gemma3-270m] [--rounds 3] [--threads 2]

Writes bench/results/ttft.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import RESULTS, write_results  # noqa: E402
from llama_build import fastest  # noqa: E402
from peers import TARGETS, bundle, gguf_files, llama_cpp, log  # noqa: E402

PROMPT = "The capital of France is"


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(command: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tree = llama_cpp()
    gguf = next(iter(gguf_files(tree, args.model).values()))
    ours = bundle(args.model, 1)
    llama = [str(fastest(tree, TARGETS, gguf, log=log).tool("llama-completion")), "-m", str(gguf), "-p", PROMPT, "-n", "1", "-t",
             str(args.threads), "-no-cnv", "--no-warmup"]

    def ovshard(in_process: bool) -> list[str]:
        return [sys.executable, "-m", "ovshard.cli", "-q", "run", str(ours), "--local", "--threads", str(args.threads),
                "--prompt", PROMPT, "--max-tokens", "1", "--speculative", "off",
                *(["--in-process"] if in_process else ["--workers"])]

    sides = {"llama.cpp": None, "ovshard workers": False, "ovshard in-process": True}
    found: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name in sides}
    dropped = True
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            in_process = sides[name]
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "OVSHARD_CACHE_DIR": cache}
                command = llama if in_process is None else ovshard(in_process)
                dropped = drop_page_cache() and dropped
                found[name]["cold"].append(timed(command, env))
                found[name]["warm"].append(timed(command, env))
            log(f"round {r}: {name}: cold {found[name]['cold'][-1]:.2f} s, warm {found[name]['warm'][-1]:.2f} s")
    report = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "page_cache_dropped": dropped,
              "prompt": PROMPT, "runs": found,
              "median_s": {n: {k: round(statistics.median(v), 3) for k, v in d.items()} for n, d in found.items()}}
    print("| process | cold s | warm s | cold vs llama.cpp | warm vs llama.cpp |\n|---|---|---|---|---|")
    base = report["median_s"]["llama.cpp"]
    for name, m in report["median_s"].items():
        print(f"| {name} | {m['cold']:.2f} | {m['warm']:.2f} | {m['cold'] / base['cold']:.2f}x | "
              f"{m['warm'] / base['warm']:.2f}x |")
    if not dropped:
        print("(the page cache could not be dropped: 'cold' runs read files from the page cache)")
    rows = [{"process": name, "cold_s": m["cold"], "warm_s": m["warm"]} for name, m in report["median_s"].items()]
    write_results("ttft", rows, report, title="time to the first token of a whole process, cold and warm")
    log(f"wrote {RESULTS / 'ttft.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
