"""Where continuous batching's time goes: one paged tick's compute against the sequences in it, per stage.

Each stage of a 2-stage bundle (``--bundle``; default: the Llama-3.2-1B shape the suite's scenario p runs) is
compiled paged with the CPU defaults and ``--threads`` threads (1: one core per stage, as scenario p runs it);
16 sequences prefill 64 tokens, then ticks of S sequences x one decode row each (S = 1, 2, 4, 8, 16) run
interleaved, ``--rounds`` times. Reported per stage: the median tick time and its multiple of a one-sequence
tick, and the ceiling that these costs put on N streams over the 2 stages when the head splits the ready
sequences into 2 pipelined groups of N/2: a stage works 2 x t(N/2) per round of N tokens, a group's round trip
is t0 + t1, so N streams give at most N (t0(1) + t1(1)) / max(2 max_k t_k(N/2), t0(N/2) + t1(N/2)) times one
stream's tokens/s, before any wire, head or scheduling cost. Then the same ticks with both stages computing at
once (two threads, one per stage, each inference on its own thread): on one machine the stages share its memory
bus and caches, which separate PCs do not; "ceiling, both at once" uses those times for the N-stream groups.
Results: bench/results/tick_cost.{json,md}.

    .venv/bin/python bench/batching/tick_cost.py [--bundle B] [--threads 1] [--rounds 12] [--prop KEY=VALUE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.manifest import read_manifest  # noqa: E402
from ovshard.runtime.engine.paged import PagedRows, compile_paged  # noqa: E402
from ovshard.runtime.node.config import stage_config  # noqa: E402

SEQUENCES = (1, 2, 4, 8, 16)
CONTEXT = 64  # positions each sequence holds before the timed ticks
STREAMS = (2, 8, 16)  # the stream counts of scenario p whose ceilings are reported


def default_bundle() -> Path:
    from scenarios_base import DEFAULT_CACHE, MODELS, Bench, Settings

    bench = Bench(Settings(models=("llama-3.2-1b",), rounds=1, warmup=0, cache=DEFAULT_CACHE,
                           results=HERE / "results"))
    return bench.bundle(MODELS["llama-3.2-1b"], 2)


def tick_times(bundle: Path, threads: int, rounds: int,
               props: dict[str, str] | None = None) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
    """Per stage: sequences per tick -> median seconds of one tick, alone and with the other stage computing;
    ``props``: CPU plugin properties over the bundle's hints."""
    manifest, core = read_manifest(bundle), ov.Core()
    rng = np.random.default_rng(0)
    per_seq = -(-(CONTEXT + 1) // 32) + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(SEQUENCES))]
    stages, makers = [], []
    for index in range(manifest.num_stages):
        stage = compile_paged(core, bundle, manifest, index, "CPU", {**(stage_config(False, threads) or {}), **(props or {})},
                              per_seq * max(SEQUENCES), slice_logits=True)
        if index == 0:
            def rows(n: int) -> np.ndarray:
                return rng.integers(0, manifest.architecture.vocab_size, n)
        else:
            def rows(n: int, width: int = manifest.architecture.hidden_size) -> np.ndarray:
                return rng.standard_normal((n, width)).astype(np.float32)
        for table in tables:
            stage.run([PagedRows(rows(CONTEXT), 0, table, 1)])
        stages.append(stage)
        makers.append(rows)

    def tick(k: int, n: int) -> float:
        x = [makers[k](1) for _ in range(n)]
        began = time.perf_counter()
        stages[k].run([PagedRows(x[i], CONTEXT, tables[i], 1) for i in range(n)])
        return time.perf_counter() - began

    alone: list[dict[int, list[float]]] = [{n: [] for n in SEQUENCES} for _ in stages]
    paired: list[dict[int, list[float]]] = [{n: [] for n in SEQUENCES} for _ in stages]
    for r in range(rounds):
        for n in (SEQUENCES if r % 2 == 0 else SEQUENCES[::-1]):
            for k in range(len(stages)):
                alone[k][n].append(tick(k, n))
            with ThreadPoolExecutor(len(stages)) as pool:  # every stage at once, each on its own thread
                for k, got in enumerate(pool.map(lambda k, n=n: [tick(k, n) for _ in range(3)], range(len(stages)))):
                    paired[k][n].append(statistics.median(got))
    medians = [[{n: statistics.median(v) for n, v in per.items()} for per in side] for side in (alone, paired)]
    for k in range(len(stages)):
        print(f"stage {k}: " + ", ".join(f"{n} seqs {medians[0][k][n] * 1e3:.1f} ms alone, "
                                         f"{medians[1][k][n] * 1e3:.1f} ms both at once" for n in SEQUENCES),
              file=sys.stderr, flush=True)
    return medians[0], medians[1]


def ceiling(times: list[dict[int, float]], streams: int, one_stream: list[dict[int, float]] | None = None) -> float:
    """N streams over 2 stages in 2 groups of N/2, against one stream (this module's docstring); the groups'
    ticks cost ``times``, one stream's ``one_stream`` (default: the same)."""
    group = -(-streams // 2)
    t0, t1 = times[0], times[1]
    one = (one_stream or times)[0][1] + (one_stream or times)[1][1]
    g0, g1 = np.interp(group, SEQUENCES, [t0[n] for n in SEQUENCES]), np.interp(group, SEQUENCES,
                                                                               [t1[n] for n in SEQUENCES])
    return streams * one / max(2 * max(g0, g1), g0 + g1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="a 2-stage bundle (default: the Llama-3.2-1B shape, INT4)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prop", action="append", default=[], metavar="KEY=VALUE",
                        help="a CPU plugin property over the bundle's hints (repeatable)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    bundle = args.bundle or default_bundle()
    if read_manifest(bundle).num_stages != 2:
        parser.error(f"{bundle}: the ceilings assume 2 stages; compile it with --stages 2")
    props = dict(p.split("=", 1) for p in args.prop)
    alone, paired = tick_times(bundle, args.threads, args.rounds, props)
    rows: list[dict[str, object]] = []
    for side, times in (("alone", alone), ("both at once", paired)):
        rows += [{"stage": f"{k} ({side})", **{f"{n} seqs ms": round(t[n] * 1e3, 1) for n in SEQUENCES},
                  **{f"{n} seqs / 1": round(t[n] / t[1], 2) for n in SEQUENCES[1:]},
                  **{f"{n} streams": "" for n in STREAMS}} for k, t in enumerate(times)]
    blank = {**{f"{n} seqs ms": "" for n in SEQUENCES}, **{f"{n} seqs / 1": "" for n in SEQUENCES[1:]}}
    rows.append({"stage": "ceiling, N streams / 1 stream (ticks alone)", **blank,
                 **{f"{n} streams": round(ceiling(alone, n), 2) for n in STREAMS}})
    rows.append({"stage": "ceiling, N streams / 1 stream (both at once)", **blank,
                 **{f"{n} streams": round(ceiling(paired, n, alone), 2) for n in STREAMS}})
    meta = {"bundle": str(bundle), "threads": args.threads, "rounds": args.rounds, "properties": props}
    print(write_results("tick_cost", rows, meta, out=args.out, title="a paged tick's compute against its sequences"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
