#!/usr/bin/env python
"""How far mask-rewind logits are from physical-trim logits (f32 hints, stories260K, one stage).

Random feed / reject sequences, as tests/runtime/decoding/test_speculative.py draws them; every step compares the
logits of a cache rewound by mask against one trimmed physically, grouped by whether the masked cache
has holes and whether the step feeds one token or several. Reproduce:

    CI=true .venv/bin/python bench/batching/rewind_diff.py [--sequences 300]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import STORIES, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.passes import WeightFormat  # noqa: E402
from ovshard.runtime.engine.kv import KVCache, StepInputs  # noqa: E402
from ovshard.runtime.engine.stage import EXACT_HINTS  # noqa: E402


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
    table = []
    for (holes, multi), rows in sorted(diffs.items()):
        absolute, relative = np.array(rows).T
        table.append({"holes": "yes" if holes else "no", "tokens a step": ">1" if multi else "1", "steps": len(rows),
                      "max abs": float(f"{absolute.max():.3g}"), "max rel (to max(1,|logit|))": float(f"{relative.max():.3g}"),
                      "steps > 1e-5 abs": f"{100 * (absolute > 1e-5).mean():.1f}%"})
    print(write_results("rewind_diff", table, {"sequences": args.sequences, "seed": args.seed},
                        title="mask-rewind logits against physical-trim logits"))

if __name__ == "__main__":
    main()
