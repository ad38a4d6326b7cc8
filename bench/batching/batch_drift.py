"""How far a batched row drifts from the same row run alone, on paged stages: default CPU hints vs --exact.

Each of S prompts is prefilled alone, then decoded T steps twice in the same paged stages (separate block
tables): once all S sequences in one inference a step (batched), once each sequence alone; both feed the
alone run's greedy tokens (teacher forcing), so the rows see the same inputs and only the batch differs. For
each step and sequence it compares the last stage's logits: max |batched - alone|, that over the row's
logit spread (max - min), and whether the greedy token agrees. Hints: the manifest's defaults (f16/bf16
math, a u8 KV cache, dynamic quantization) and EXACT_HINTS (f32).

    .venv/bin/python bench/batching/batch_drift.py BUNDLE [--sequences 8] [--steps 32]

Writes bench/results/batch_drift.{json,md}; a table on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import openvino as ov

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.manifest import read_manifest  # noqa: E402
from ovshard.runtime.engine.paged import PagedRows, PagedStage, blocks_for, compile_paged  # noqa: E402
from ovshard.runtime.engine.stage import EXACT_HINTS  # noqa: E402


def run(stages: list[PagedStage], seqs: list[PagedRows]) -> list[np.ndarray]:
    """One inference a stage over ``seqs``; the last stage's logits rows of each."""
    rows = seqs
    for stage in stages:
        outs = stage.run(rows)
        rows = [PagedRows(x, r.position, r.blocks, r.want) for x, r in zip(outs, rows, strict=True)]
    return [r.x for r in rows]


def drift(bundle: Path, config: dict | None, sequences: int, steps: int, prompt_len: int) -> dict:
    manifest, core = read_manifest(bundle), ov.Core()
    per = blocks_for(prompt_len + steps + 1, 32)
    stages = [compile_paged(core, bundle, manifest, i, config=config, num_blocks=2 * sequences * per)
              for i in range(manifest.num_stages)]
    vocab = manifest.architecture.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(vocab, 20000), prompt_len).astype(np.int64) for _ in range(sequences)]
    tables = {(s, side): list(range((2 * s + side) * per, (2 * s + side + 1) * per))
              for s in range(sequences) for side in (0, 1)}
    tokens = []
    for s, prompt in enumerate(prompts):  # prefill both copies alone
        for side in (0, 1):
            logits = run(stages, [PagedRows(prompt, 0, tables[s, side])])[0]
        tokens.append(int(logits[-1].argmax()))
    diffs, spreads, agree = [], [], []
    for step in range(steps):
        position = prompt_len + step
        batched = run(stages, [PagedRows(np.array([tokens[s]]), position, tables[s, 1]) for s in range(sequences)])
        for s in range(sequences):
            alone = run(stages, [PagedRows(np.array([tokens[s]]), position, tables[s, 0])])[0][-1]
            row = batched[s][-1]
            diffs.append(float(np.abs(row - alone).max()))
            spreads.append(float(alone.max() - alone.min()))
            agree.append(int(row.argmax()) == int(alone.argmax()))
            tokens[s] = int(alone.argmax())
    rel = [d / max(sp, 1e-9) for d, sp in zip(diffs, spreads, strict=True)]
    return {"max_abs_diff": max(diffs), "median_abs_diff": float(np.median(diffs)), "max_rel_diff": max(rel),
            "greedy_agreement": sum(agree) / len(agree), "rows": len(diffs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens of each sequence")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    rows = []
    for name, config in (("default hints", None), ("--exact", EXACT_HINTS)):
        print(f"batch_drift: {name}", file=sys.stderr)
        rows.append({"hints": name, **{k: round(v, 6) if isinstance(v, float) else v
                                       for k, v in drift(args.bundle, config, args.sequences, args.steps,
                                                         args.prompt).items()}})
    meta = {"bundle": str(args.bundle), "sequences": args.sequences, "steps": args.steps, "prompt": args.prompt}
    print(write_results("batch_drift", rows, meta, out=args.results, title="batched rows against rows alone"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
