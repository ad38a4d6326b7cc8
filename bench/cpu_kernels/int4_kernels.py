"""Decode speed of weight formats on the Llama-3.2-1B shape: INT4 sym vs asym kernels, group size, INT8 share.

Issue 17 asks for CPU settings chosen by measurement, INT4 sym against asym kernels among them. Each format
is one ``ovshard compile`` of the random-weight 1B-shaped checkpoint (make bench's, one stage, cached under
``--work``); all bundles are then loaded in this process (``LocalPipeline``, the CPU plugin's defaults, all
threads) and decode ``--tokens`` greedy tokens after the suite's 16-token prompt, interleaved in rounds with
the first format rotating. Reported: the .bin size, decode tokens/s (median) and the median of per-round
ratios to the default compile. Accuracy is the INT4 frontier's business (docs/results/2026-12-int4-accuracy.md); this is
speed only. With ``--checkpoint`` (a real model: a folder with its tokenizer, or a GGUF file) the default
compile calibrates its INT4 weights, and the row "default, data-free" measures what calibration costs in
decode speed (``--formats 0,1`` compares just those two).

    CI=true .venv/bin/python bench/cpu_kernels/int4_kernels.py [--rounds 3] [--tokens 64] [--checkpoint PATH] [--formats 0,1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (bench/report.py: the suite's tables)
from compile_memory import ensure_checkpoint  # noqa: E402  (make bench's 1B checkpoint)
from scenarios_base import MODELS  # noqa: E402

FORMATS = {  # label -> extra `ovshard compile` arguments
    "default (int4_sym g128, budget 1.15)": [],
    "default, data-free (--calibration none)": ["--calibration", "none"],
    "int4_sym g128, every decoder weight INT4": ["--budget", "1.0"],
    "int4_asym g128, every decoder weight INT4": ["--weights", "int4_asym", "--budget", "1.0"],
    "int4_sym per channel, every decoder weight INT4": ["--group-size", "-1", "--budget", "1.0"],
    "int4_sym g128, INT4 embedding and lm_head too": ["--budget", "1.0", "--all-layers"],
    "int8 per channel": ["--weights", "int8"],
}


def compiled(checkpoint: Path, work: Path, label: str, extra: list[str]) -> Path:
    out = work / "".join(c if c.isalnum() else "_" for c in label)[:60]
    if not (out / "manifest.json").is_file():
        print(f"compiling {label}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(checkpoint), "-o", str(out),
                        "--stages", "1", "--max-positions", "1024", "--no-cache", *extra], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def decode(pipeline, prompt: list[int], tokens: int) -> float:  # noqa: ANN001  (a LocalPipeline)
    pipeline.reset()
    logits = pipeline.step(prompt, 0, "argmax")
    token, position, spent = int(logits.values[-1]), len(prompt), 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        token = int(pipeline.step([token], position, "argmax").values[-1])
        spent += time.perf_counter() - start
        position += 1
    return tokens / spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ovshard-bench/kernels"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--checkpoint", type=Path, help="a real model instead of the random 1B-shaped checkpoint")
    parser.add_argument("--formats", help="the rows to run, by index (0 = the default, which every run keeps)")
    args = parser.parse_args()
    from ovshard.runtime.client.inprocess import LocalPipeline

    checkpoint = args.checkpoint or Path("/tmp/ovshard-bench/ckpt-llama-3.2-1b-bfloat16")
    if args.checkpoint is None:
        ensure_checkpoint(checkpoint, "llama-3.2-1b", "bfloat16")
    chosen = sorted({0, *map(int, args.formats.split(","))}) if args.formats else range(len(FORMATS))
    formats = {label: extra for i, (label, extra) in enumerate(FORMATS.items()) if i in chosen}
    work = args.work / checkpoint.name  # bundles are reused by label: one folder a checkpoint
    bundles = {label: compiled(checkpoint, work, label, extra) for label, extra in formats.items()}
    pipelines = {label: LocalPipeline(b, slice_logits=True) for label, b in bundles.items()}
    vocab = next(iter(pipelines.values())).vocab_size
    prompt = [t % vocab for t in MODELS["llama-3.2-1b"].prompt]  # the 1B shape's ids, folded into the vocabulary
    labels, samples = list(formats), {label: [] for label in formats}
    for label in labels:  # warm-up
        decode(pipelines[label], prompt, 4)
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            samples[label].append(decode(pipelines[label], prompt, args.tokens))
            print(f"round {r}: {label} {samples[label][-1]:.2f} tok/s", file=sys.stderr, flush=True)
    base = labels[0]
    rows = [{"format": label, "bin MB": round(sum(f.stat().st_size for f in bundles[label].glob("*.bin")) / 1e6),
             "decode tok/s": round(statistics.median(samples[label]), 2),
             "vs default (median of rounds)": round(statistics.median(
                 [a / b for a, b in zip(samples[label], samples[base], strict=True)]), 3),
             "samples": samples[label]} for label in labels]
    command = "CI=true .venv/bin/python bench/cpu_kernels/int4_kernels.py " + " ".join(sys.argv[1:])
    columns = ["format", "bin MB", "decode tok/s", "vs default (median of rounds)"]
    print(report.write_rows(args.out, "int4_kernels", command, rows, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
