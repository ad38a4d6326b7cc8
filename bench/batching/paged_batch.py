"""What a paged stage buys: S sequences decoding, one paged inference a stage for all S rows, against S paged
inferences of one row and S stateful streams (one InferRequest each, the runtime's path today).

A 2-stage fp32 bundle of the real stories260K (or ``--bundle``); every tick each sequence of each method
appends one token at its next position (context 64 -> 64 + rounds); the three methods run interleaved in one
process, tick by tick, and the medians' ratios are reported (timings drift +-50% between processes here).
Results: bench/results/paged_batch.{json,md}.

    .venv/bin/python bench/batching/paged_batch.py [--bundle B] [--sequences 8] [--rounds 200] [--exact]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import STORIES, interleaved, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.manifest import Manifest, read_manifest  # noqa: E402
from ovshard.runtime.engine.paged import PagedRows, PagedStage, compile_paged  # noqa: E402
from ovshard.runtime.engine.stage import EXACT_HINTS, Stage  # noqa: E402
from ovshard.runtime.scheduling.block_tables import BlockManager, NoBlocks  # noqa: E402

CONTEXT = 64
NEXT = np.array([5], dtype=np.int64)  # the token every sequence appends each tick


class PagedSequences:
    """Sequences on the paged stages, their block tables from one BlockManager."""

    def __init__(self, stages: list[PagedStage], manager: BlockManager) -> None:
        self.stages, self.manager = stages, manager

    def step(self, seqs: list[str], ids: list[np.ndarray]) -> None:
        """One inference a stage over every sequence's new ids (its prompt when it is new)."""
        rows = []
        for seq, x in zip(seqs, ids, strict=True):
            start = self.manager.length(seq) if seq in self.manager else 0
            granted = (self.manager.append if seq in self.manager else self.manager.allocate)(seq, x.tolist())
            if isinstance(granted, NoBlocks):
                raise SystemExit(f"the block pool is too small: {granted}")
            rows.append(PagedRows(x, start, granted.blocks))
        for stage in self.stages:
            last = stage is self.stages[-1]
            outs = stage.run([PagedRows(r.x, r.position, r.blocks, 1 if last else None) for r in rows])
            rows = [PagedRows(o, r.position, r.blocks) for o, r in zip(outs, rows, strict=True)]
        for seq in seqs:
            self.manager.commit(seq)


def methods(bundle: Path, m: Manifest, sequences: int, rounds: int, hints: dict | None) -> dict[str, Callable[[], None]]:
    """The three ways to decode ``sequences`` rows a tick, each primed with the same prompts."""
    core = ov.Core()
    blocks = 2 * sequences * -(-(CONTEXT + rounds + 2) // 32)
    stages = [compile_paged(core, bundle, m, i, config=hints, num_blocks=blocks, slice_logits=True)
              for i in range(m.num_stages)]
    paged = PagedSequences(stages, BlockManager(blocks, stages[0].block_size, prefix_cache=False))
    prompts = [np.random.default_rng(i).integers(3, m.architecture.vocab_size, CONTEXT) for i in range(sequences)]
    one, apart = [f"one{i}" for i in range(sequences)], [f"apart{i}" for i in range(sequences)]
    paged.step(one, prompts)
    for seq, prompt in zip(apart, prompts, strict=True):
        paged.step([seq], [prompt])
    streams = [[Stage(bundle, m, i, core, config=hints, slice_logits=True) for i in range(m.num_stages)]
               for _ in range(sequences)]
    positions = [CONTEXT] * sequences
    for prompt, chain in zip(prompts, streams, strict=True):
        x = prompt[None]
        for stage in chain:
            x = stage.step(x, 0, rows=1)

    def stateful() -> None:
        for i, chain in enumerate(streams):
            x = NEXT[None]
            for stage in chain:
                x = stage.step(x, positions[i], rows=1)
            positions[i] += 1

    return {f"one paged inference a stage ({sequences} rows)": lambda: paged.step(one, [NEXT] * sequences),
            f"{sequences} paged inferences a stage (1 row)": lambda: [paged.step([s], [NEXT]) for s in apart],
            f"{sequences} stateful streams (1 row)": stateful}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="a bundle (default: stories260K compiled fp32 in 2 stages)")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--exact", action="store_true", help="f32 inference and KV cache")
    args = parser.parse_args()
    bundle = args.bundle
    if bundle is None:
        from ovshard.compile import CompileConfig, compile_bundle
        from ovshard.passes import WeightFormat

        bundle = Path(tempfile.mkdtemp(prefix="paged-batch-")) / "b2"
        compile_bundle(CompileConfig(STORIES, bundle, stages=2, weights=WeightFormat("fp32")))
    m = read_manifest(bundle)
    ways = methods(bundle, m, args.sequences, args.rounds, EXACT_HINTS if args.exact else None)
    # interleaved: a slow moment of the machine falls on every method alike
    got = interleaved(ways, args.rounds, label="s a tick")
    base = got.median(got.cases[0])
    rows = [{"method": name, "ms_a_tick": round(1e3 * got.median(name), 3),
             "x_one_inference": round(got.median(name) / base, 2),
             "samples_ms": [round(1e3 * s, 3) for s in got.samples[name]]} for name in got.cases]
    meta = {"bundle": str(bundle), "sequences": args.sequences, "rounds": args.rounds, "exact": args.exact}
    print(write_results("paged_batch", rows, meta, title="paged batch: S rows in one inference a stage"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
