"""Time to the first token of a long prompt on 2 stages: one prefill step against chunked, pipelined prefill.

The real Gemma 3 270M (the PyPI GGUF; default INT4 compile, 2 stages, ``--max-positions 4096``), one worker
process per stage with ``--threads 1 --kv stateful`` (the head sends streams; the two stages share this
machine's cores), a head in this process. Each measurement opens a stream, sends the prompt (``--tokens``, the
Apache-2.0 license text repeated) and waits for the first token; ``--prefill-chunk 0`` is the whole prompt in
one step. Chunk sizes run interleaved in rounds, in a rotated order; reported: median seconds and the speed-up
over one step.

    CI=true .venv/bin/python bench/batching/chunked_prefill.py [--tokens 2048] [--chunks 0,128,256,512] [--rounds 3]
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
from harness import RESULTS, interleaved, write_results  # noqa: E402  (bench/ is not a package)

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
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from ovshard.runtime.client.head import Head
    from ovshard.runtime.client.launch import local_workers
    from ovshard.runtime.engine.sampler import SamplingConfig

    chunks = [int(c) for c in args.chunks.split(",")]
    b = bundle(args.tokens)
    ids = prompt_ids(b, args.tokens)
    first: dict[int, int] = {}
    with local_workers(b, threads=1, kv="stateful") as addresses:

        def ttft(chunk: int) -> float:
            head = Head(b, addresses, prefill_chunk=chunk, timeout=600)
            try:
                began = time.perf_counter()  # the stream's Open is timed too: the engine opens it with its first row
                (token,) = head.generate(ids, SamplingConfig(max_tokens=1))
                seconds = time.perf_counter() - began
            finally:
                head.close()
            first.setdefault(chunk, token)
            return seconds

        # round 1 warms the compiled-model caches and is not counted
        got = interleaved({str(c): lambda c=c: ttft(c) for c in chunks}, args.rounds + 1, label="s to the first token",
                          timed=False)
    samples = {int(c): s[1:] for c, s in got.samples.items()}
    base = statistics.median(samples[0]) if 0 in samples else None
    rows = [{"prefill_chunk": c, "median_ttft_s": round(statistics.median(s), 3),
             "speedup_vs_one_step": round(base / statistics.median(s), 3) if base else None,
             "samples_s": [round(x, 3) for x in s], "prompt": f"{args.tokens} tokens"} for c, s in samples.items()]
    meta = {"tokens": args.tokens, "same_first_token": len(set(first.values())) == 1}
    print(write_results("chunked_prefill", rows, meta, out=args.out,
                        title="Gemma 3 270M, 2 stages, 1 thread each: the first token, one step against chunks",
                        plot={"group_by": "prompt", "label": "--prefill-chunk {prefill_chunk}",
                              "value": "median_ttft_s", "ylabel": "time to first token, s"}))
    print(f"same first token every way: {meta['same_first_token']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
