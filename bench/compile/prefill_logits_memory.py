"""Peak memory of a long prefill on a large vocabulary, with and without logits only for the rows needed.

A random-weight Llama with Llama 3's 128,256-token vocabulary (hidden 256, 2 layers, int8 weights, so the
logits dominate) in one stage; a worker process per run (``StageWorker(slice_logits=...)``), a head in
this process that sends an 8,000-token prompt as one step and asks for the next token (``argmax@1``).
Reported: the worker's peak RSS (``VmHWM``) over its RSS once loaded, interleaved A/B over ``--rounds``.
Before the change the last stage computed ``logits [1, 8000, 128256]`` (4.1 GB of f32) to read one row.

    CI=true .venv/bin/python bench/compile/prefill_logits_memory.py [--tokens 8000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import sys
from pathlib import Path
from ovshard.runtime.client.launch import listening_line
from ovshard.runtime.node.worker import StageWorker
worker = StageWorker(Path(sys.argv[1]), 0, slice_logits=sys.argv[2] == "sliced", cache_dir=Path(sys.argv[3]))
import threading
print(listening_line(0, worker.listen("127.0.0.1", 0)), flush=True)
threading.Thread(target=lambda: (sys.stdin.read(), worker.stop()), daemon=True).start()
worker.serve_forever()
"""

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import RESULTS, interleaved, write_results  # noqa: E402  (bench/ is not a package)


def _kb(pid: int, key: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split(f"{key}:")[1].split()[0])


def run(bundle: Path, mode: str, tokens: int, cache: Path) -> dict:
    from ovshard.runtime.client.head import Head
    from ovshard.runtime.engine.sampler import SamplingConfig

    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(bundle), mode, str(cache)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address = json.loads(proc.stdout.readline())["address"]
        loaded = _kb(proc.pid, "VmRSS")
        head = Head(bundle, [address], timeout=600)
        try:
            prompt = [(7 * i) % 128000 + 1 for i in range(tokens)]
            out = list(head.generate(prompt, SamplingConfig(max_tokens=1)))
        finally:
            head.close()
        peak = _kb(proc.pid, "VmHWM")
        proc.stdin.close()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"mode": mode, "loaded_mb": round(loaded / 1024), "peak_mb": round(peak / 1024),
            "prefill_mb": round((peak - loaded) / 1024), "token": out[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from ovshard.bundle.weights import WeightFormat
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.tools.synth import llama_config, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="ovshard-prefill-") as tmp:
        root = Path(tmp)
        config = llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, vocab_size=128256, tie_word_embeddings=False,
                              max_position_embeddings=args.tokens + 16)
        ckpt = write_checkpoint(root / "ckpt", config)
        bundle = root / "bundle"
        compile_bundle(CompileConfig(ckpt, bundle, stages=1, weights=WeightFormat("int8"), cache_dir=None))
        got = interleaved({mode: lambda mode=mode: run(bundle, mode, args.tokens, root / "ov_cache")
                           for mode in ("all", "sliced")}, args.rounds, label="MB", timed=False,
                          show=lambda found: f"{found['prefill_mb']} MB over loaded")
        rows = [{"round": r, **found} for mode in got.cases for r, found in enumerate(got.samples[mode])]
    tokens = {r["token"] for r in rows}
    by = {m: sorted(r["prefill_mb"] for r in rows if r["mode"] == m) for m in ("all", "sliced")}
    summary = {"tokens": args.tokens, "vocab": 128256, "same_next_token": len(tokens) == 1,
               "prefill_mb_all_rows": by["all"], "prefill_mb_sliced": by["sliced"]}
    print(write_results("prefill_logits_memory", rows, summary, out=args.out,
                        title="a long prefill's peak memory on a 128K vocabulary, logits of every row or those asked"))
    print(f"prefill MB over loaded, every row (before): {by['all']}; the rows asked for (after): {by['sliced']}")
    print(f"same next token: {summary['same_next_token']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
