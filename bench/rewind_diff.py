#!/usr/bin/env python
"""How far mask-rewind logits are from physical-trim logits (f32 hints, stories260K, one stage).

Random feed / reject sequences, as tests/runtime/decoding/test_speculative.py draws them; every step compares the
logits of a cache rewound by mask against one trimmed physically, grouped by whether the masked cache
has holes and whether the step feeds one token or several. Reproduce:

    CI=true .venv/bin/python bench/rewind_diff.py [--sequences 300]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.compile import CompileConfig, compile_bundle
from ovshard.passes import WeightFormat
from ovshard.runtime.engine.kv import KVCache, StepInputs
from ovshard.runtime.engine.stage import EXACT_HINTS

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compile_bundle(CompileConfig(STORIES, Path(tmp) / "b", weights=WeightFormat("fp32")))
        compiled = ov.Core().compile_model(str(Path(tmp) / "b" / manifest.stages[0].model_xml), "CPU", EXACT_HINTS)
    out, rng = compiled.output(0), np.random.default_rng(args.seed)
    diffs: dict[tuple[bool, bool], list[tuple[float, float]]] = collections.defaultdict(list)
    for _ in range(args.sequences):
        masked, trimmed = KVCache(compiled.create_infer_request()), KVCache(compiled.create_infer_request())
        reject = 0
        for _ in range(rng.integers(1, 9)):
            feed = int(rng.integers(1, 7))
            inputs = StepInputs("input_ids", rng.integers(3, 512, size=(1, feed)), masked.visible - reject,
                                (1,) * feed, manifest.runtime_hints.max_positions)
            trimmed.trim(reject)
            a = masked.step(inputs, out, rewind=reject).copy()
            b = trimmed.step(inputs, out).copy()
            diff = np.abs(a - b)
            diffs[(masked.holes > 0, feed > 1)].append((float(diff.max()),
                                                         float((diff / np.maximum(1.0, np.abs(b))).max())))
            reject = min(int(rng.integers(0, 7)), feed)
    print("| holes | tokens a step | steps | max abs | max rel (to max(1,|logit|)) | steps > 1e-5 abs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (holes, multi), rows in sorted(diffs.items()):
        absolute, relative = np.array(rows).T
        print(f"| {'yes' if holes else 'no'} | {'>1' if multi else '1'} | {len(rows)} | {absolute.max():.3g} | "
              f"{relative.max():.3g} | {100 * (absolute > 1e-5).mean():.1f}% |")


if __name__ == "__main__":
    main()
