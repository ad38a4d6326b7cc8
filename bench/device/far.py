"""The paper's far rows, as phases of bench/device/paper.py: a quarter of the 70B shape as one node's stage, and
the 8B layout behind 100 ms links.

  quarter  a 20-layer cut of the Llama-3.1-70B shape (a quarter of its 80 layers), the default compile
           (data-free: random weights), one stage with its embedding and lm_head; in this process, pinned to a
           node's cores, on the paged form: a decode step of 1, 2 and 8 sequences and a verify step of K+1 rows
           (K = 10, the paper's) at 1K and 8K positions of context. A step's cost does not depend on what the
           cache holds, so no prompt is run: the rows attend to positions the step does not write. From these
           steps, the rates four such nodes imply (five hops, each 0.3 ms + one f32 activation row at 1 Gbit/s;
           every quarter counted with an lm_head, so a little slow): plain, prompt lookup at K = 10 with the
           acceptance measured on real models (bench/against_llama_cpp/spec_copy.py), 2 streams and 8 streams, beside the paper's
           1.74 / 5.42 / 6.43 tok/s (4 Lunar Lake laptops).
  wan      the 8B shape over 2 pinned "nodes" behind relays of 100 ms one way (the table's workers): naive
           pipeline decode (one user, no speculation) against 2 users, prompt lookup (--draft-k auto) and both
           (the paper: sharding + speculation + 2 streams = 4.04x naive). Random weights: prompt lookup accepts
           what the shape happens to repeat, so the acceptance is printed beside each row.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any

QUARTER_LAYERS = 20
CONTEXTS = (1024, 8192)
SEQUENCES = (1, 2, 8)
VERIFY_K = 10  # the paper's drafts a step for its 70B run
STEPS = 6
NODES = 4
PAPER_70B = {"plain": 1.74, "speculation K=10": 5.42, "2 streams": 6.43}
# prompt lookup's acceptance on real models, copy-style tasks (docs/results/2026-12-against-llama-cpp.md): low, high
ACCEPTANCE = (0.61, 0.77)
WAN_DELAY_S = 0.1
PAPER_WAN = 4.04


def tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens a verify step of ``k`` drafts yields when each draft is accepted with ``acceptance``
    (independently, up to the first rejection), plus the target's own token."""
    return sum(acceptance ** i for i in range(k + 1))


def quarter(paper: ModuleType, work: Path, results: Any, threads: int) -> None:
    import numpy as np
    import openvino as ov

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.paged import BLOCK_SIZE, PagedRows, compile_paged

    out = work / "bundle-70b-quarter"
    found: dict[str, Any] = {"layers": QUARTER_LAYERS, "threads": threads}
    if not (out / "manifest.json").is_file():
        ckpt = paper.checkpoint(work, "llama-3.1-70b", QUARTER_LAYERS)
        paper.log(f"quarter: compiling {QUARTER_LAYERS} layers of the 70B shape (default, data-free)")
        found["compile"] = paper.compile_bundle(ckpt, out, 1, ("--calibration", "none"),
                                                positions=max(CONTEXTS) + 2 * BLOCK_SIZE)
        shutil.rmtree(ckpt)
        paper.log(f"quarter: compiled {found['compile']}")
        results.put("quarter", found)
    found["bundle_gb"] = round(sum(f.stat().st_size for f in out.glob("*.bin")) / 1e9, 2)
    manifest = read_manifest(out)
    per_seq = -(-(max(CONTEXTS) + VERIFY_K + 1) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(SEQUENCES))]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(range(threads)))
    try:
        stage = compile_paged(ov.Core(), out, manifest, 0, config={"INFERENCE_NUM_THREADS": str(threads)},
                              num_blocks=per_seq * max(SEQUENCES), slice_logits=True)
        rng = np.random.default_rng(0)
        vocab = manifest.architecture.vocab_size
        steps: dict[str, float] = {}
        for context in CONTEXTS:
            for seqs, rows in [(s, 1) for s in SEQUENCES] + [(1, VERIFY_K + 1)]:
                batch = [PagedRows(rng.integers(0, vocab, rows).astype(np.int64), context, tables[i], rows)
                         for i in range(seqs)]
                stage.run(batch)  # the plugin prepares this shape's kernels
                walls = []
                for _ in range(STEPS):
                    start = time.perf_counter()
                    stage.run(batch)
                    walls.append(time.perf_counter() - start)
                steps[f"{context} {seqs}x{rows}"] = round(statistics.median(walls), 4)
                paper.log(f"quarter: context {context}, {seqs} sequences x {rows} rows: {steps[f'{context} {seqs}x{rows}']} s")
                found["step_s"] = steps
                results.put("quarter", found)
    finally:
        os.sched_setaffinity(0, before)
    found["rates"] = implied_rates(steps, manifest.architecture.hidden_size, paper)
    found["paper tok/s"] = PAPER_70B
    results.put("quarter", found)


def implied_rates(steps: dict[str, float], hidden: int, paper: ModuleType) -> list[dict[str, Any]]:
    """Four nodes of one quarter each: tokens/s for one user plain and with prompt lookup, 2 and 8 streams.
    2 streams ride as 2 groups of 1 (half the stages idle at a time); 8 as 4 groups of 2, every stage busy."""
    hop = paper.DELAY_S + 4 * hidden / paper.LINK_BYTES_PER_S
    links = (NODES + 1) * hop
    rows = []
    for context in CONTEXTS:
        one, two, verify = (steps[f"{context} {s}"] for s in ("1x1", "2x1", f"1x{VERIFY_K + 1}"))
        row: dict[str, Any] = {"context": context, "plain": round(1 / (NODES * one + links), 2),
                               "2 streams": round(2 / (NODES * one + links), 2),
                               "8 streams": round(8 / (NODES * two + links), 2)}
        for acceptance in ACCEPTANCE:
            tokens = tokens_per_step(acceptance, VERIFY_K)
            row[f"prompt lookup K={VERIFY_K} at {acceptance}"] = round(tokens / (NODES * verify + links), 2)
            row[f"2 streams + lookup at {acceptance}"] = round(2 * tokens / (NODES * verify + links), 2)
        rows.append(row)
    return rows


def wan(paper: ModuleType, state: dict[str, Any], work: Path, results: Any, rounds: int, tokens: int) -> None:
    from scenarios_streams import _aggregate

    from ovshard.runtime.client.head import Head
    from ovshard.runtime.decoding.speculative import make_speculation

    bundle = state.get("bundles", {}).get("llama-3.1-8b", {}).get("2")
    found: dict[str, Any] = {"delay_ms_one_way": WAN_DELAY_S * 1000, "node_cores": paper.NODE_CORES,
                             "tokens_per_user": tokens}
    if bundle is None:
        bundle = str(work / "bundle-llama-3.1-8b-wan")
        if not (Path(bundle) / "manifest.json").is_file():
            ckpt = paper.checkpoint(work, "llama-3.1-8b")
            found["compile"] = paper.compile_bundle(ckpt, Path(bundle), 2, ("--calibration", "none"))
            shutil.rmtree(ckpt)
            paper.log(f"wan: compiled the 8B shape in 2 stages {found['compile']}")
    os.sched_setaffinity(0, set(range(2 * paper.NODE_CORES, os.cpu_count() or 2 * paper.NODE_CORES))
                         or {0})
    prompt = paper.prompt_for(bundle)
    samples: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        head = Head(Path(bundle), paper._workers(stack, bundle, paper.NODE_CORES, WAN_DELAY_S), timeout=600)
        stack.callback(head.close)
        lookup = make_speculation("prompt-lookup", "auto", head.manifest)
        cases = {"naive: 1 user, plain": (1, None), "2 users": (2, None), "1 user + prompt lookup": (1, lookup),
                 "2 users + prompt lookup": (2, lookup)}
        _aggregate(head, [prompt], 2, 1, None)  # warm-up
        for r in range(rounds):
            for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                users, speculation = cases[name]
                got = _aggregate(head, [prompt[: len(prompt) - i] for i in range(users)], tokens, users, speculation)
                samples.setdefault(name, []).append(got)
                paper.log(f"wan: round {r} {name}: {got['tokens_per_s']:.2f} tok/s, acceptance {got['acceptance']:.2f}")
            base = statistics.median(g["tokens_per_s"] for g in samples["naive: 1 user, plain"])
            found["rows"] = [{"case": name, "tok/s": round(statistics.median(g["tokens_per_s"] for g in got), 2),
                              "vs naive": round(statistics.median(g["tokens_per_s"] for g in got) / base, 2),
                              "acceptance": round(statistics.median(g["acceptance"] for g in got), 2)}
                             for name, got in samples.items()]
            found["paper"] = f"{PAPER_WAN}x naive (sharding + speculation + 2 streams)"
            results.put("wan", found)
