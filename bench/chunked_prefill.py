"""Time to the first token of a long prompt on 2 stages: one prefill step against chunked, pipelined prefill.

The real Gemma 3 270M (the PyPI GGUF; default INT4 compile, 2 stages, ``--max-positions 4096``), one worker
process per stage with ``--threads 1`` (the two stages share this machine's cores), a head in this process.
Each measurement opens a stream, sends the prompt (``--tokens``, the Apache-2.0 license text repeated) and
waits for the first token; ``--prefill-chunk 0`` is the whole prompt in one step. Chunk
sizes run interleaved in rounds, in a rotated order; reported: median seconds and the speed-up over one step.

    CI=true .venv/bin/python bench/chunked_prefill.py [--tokens 2048] [--chunks 0,128,256,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path("/tmp/ovshard-bench/bundles")


def bundle(tokens: int) -> Path:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from real_gemma import gemma_gguf_path

    positions = max(4096, tokens + 64)
    out = CACHE / f"gemma3-270m-2st-int4-p{positions}"
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(gemma_gguf_path()), "-o", str(out),
                        "--stages", "2", "--max-positions", str(positions)], check=True, stdout=subprocess.DEVNULL)
    return out


def prompt_ids(bundle: Path, tokens: int) -> list[int]:
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

    from ovshard.bundle.manifest import read_manifest

    m = read_manifest(bundle)
    encode = ov.Core().compile_model(bundle / m.tokenizer.tokenizer)
    ids = encode([(HERE / "texts" / "apache-2.0.txt").read_text()])["input_ids"][0].tolist()
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", default="0,128,256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    from ovshard.runtime.client.head import Head, StreamTarget
    from ovshard.runtime.client.launch import local_workers

    chunks = [int(c) for c in args.chunks.split(",")]
    b = bundle(args.tokens)
    ids = prompt_ids(b, args.tokens)
    samples: dict[int, list[float]] = {c: [] for c in chunks}
    first: dict[int, int] = {}
    with local_workers(b, threads=1) as addresses:
        for r in range(args.rounds + 1):  # round 0 warms the compiled-model caches and is not counted
            order = chunks[r % len(chunks):] + chunks[:r % len(chunks)]
            for chunk in order:
                head = Head(b, addresses, prefill_chunk=chunk, timeout=600)
                try:
                    target = StreamTarget(head)
                    began = time.perf_counter()
                    token = target.step(ids, 0, "argmax@1", 0, False).argmax(0)
                    seconds = time.perf_counter() - began
                    target.close()
                finally:
                    head.close()
                first.setdefault(chunk, token)
                if r > 0:
                    samples[chunk].append(seconds)
                print(json.dumps({"round": r, "chunk": chunk, "ttft_s": round(seconds, 3), "token": token}),
                      file=sys.stderr, flush=True)
    base = statistics.median(samples[0]) if 0 in samples else None
    rows = [{"prefill_chunk": c, "median_ttft_s": round(statistics.median(s), 3),
             "speedup_vs_one_step": round(base / statistics.median(s), 3) if base else None,
             "samples_s": [round(x, 3) for x in s]} for c, s in samples.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    command = "CI=true .venv/bin/python bench/chunked_prefill.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "tokens": args.tokens, "same_first_token": len(set(first.values())) == 1,
              "rows": rows}
    (args.out / "chunked_prefill.json").write_text(json.dumps(result, indent=2))
    lines = ["| --prefill-chunk | median TTFT s | speed-up vs one step | samples s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['prefill_chunk']} | {r['median_ttft_s']} | {r['speedup_vs_one_step']} | "
              f"{', '.join(map(str, r['samples_s']))} |" for r in rows]
    table = "\n".join(lines)
    (args.out / "chunked_prefill.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.bar([str(r["prefill_chunk"]) for r in rows], [r["median_ttft_s"] for r in rows])
        ax.set_xlabel("--prefill-chunk (0: one step)")
        ax.set_ylabel(f"time to first token, s ({args.tokens} tokens)")
        ax.set_title("Gemma 3 270M, 2 stages, 1 thread each")
        fig.tight_layout()
        fig.savefig(args.out / "chunked_prefill.png", dpi=110)
    except ImportError:
        pass
    print(table)
    print(f"same first token every way: {result['same_first_token']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
