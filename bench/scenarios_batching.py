"""Continuous batching: p (1, 2, 8, 16 concurrent streams on 2 stages over loopback TCP, paged workers that batch
every stream into one inference a tick vs stateful workers that step each stream alone; aggregate decode
tokens/s), and q (prefix reuse: a shared system prompt, and a chat history seen before: time to first token)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

from scenarios_base import Bench, median, progress, scenario
from scenarios_streams import _aggregate, _prompts

from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.engine.sampler import SamplingConfig

STREAMS = (1, 2, 8, 16)
THREADS_PER_STAGE = 1  # one core per stage stands in for one machine per stage
TARGETS = {2: 1.95, 8: 5.0, 16: 7.0}  # aggregate tokens/s over one stream (paged)
ALONE_TARGET = 0.97  # one stream, paged / stateful


@scenario("p", "continuous batching: 1, 2, 8, 16 streams on 2 stages, paged (batched) vs stateful workers")
def batching(bench: Bench) -> dict[str, Any]:
    rows, raw, summary = [], {}, []
    for model in bench.models:
        tokens = bench.settings.tokens(model)
        bundle = bench.bundle(model, 2)
        samples: dict[str, list[dict[str, float]]] = {f"{kv} {n}": [] for kv in ("paged", "stateful") for n in STREAMS}
        with ExitStack() as stack:
            heads = {}
            for kv in ("paged", "stateful"):
                addresses = stack.enter_context(local_workers(bundle, threads=THREADS_PER_STAGE, kv=kv))
                heads[kv] = Head(bundle, addresses, timeout=600)
                stack.callback(heads[kv].close)
                _aggregate(heads[kv], _prompts(model.name, model.prompt, 2), 8, 2, None)  # warm-up
            for r in range(bench.settings.rounds):
                for n in (STREAMS if r % 2 == 0 else STREAMS[::-1]):
                    for kv in (("paged", "stateful") if r % 2 == 0 else ("stateful", "paged")):
                        got = _aggregate(heads[kv], _prompts(model.name, model.prompt, n), tokens, n, None)
                        samples[f"{kv} {n}"].append(got)
                        progress(f"p: {model.name} {kv} {n} streams: {got['tokens_per_s']:.1f} tok/s")
            stats = heads["paged"].chain.batcher.stats if heads["paged"].chain.batcher else None

        def ratio(a: str, b: str, samples: dict[str, list[dict[str, float]]] = samples) -> float:
            return round(median([x["tokens_per_s"] / y["tokens_per_s"]
                                 for x, y in zip(samples[a], samples[b], strict=True)]), 2)

        for n in STREAMS:
            rows.append({"model": model.name, "streams": n,
                         "paged_tok_s": round(median([s["tokens_per_s"] for s in samples[f"paged {n}"]]), 2),
                         "stateful_tok_s": round(median([s["tokens_per_s"] for s in samples[f"stateful {n}"]]), 2),
                         "paged_vs_paged_1": ratio(f"paged {n}", "paged 1"),
                         "paged_vs_stateful_1": ratio(f"paged {n}", "stateful 1"),
                         "stateful_vs_stateful_1": ratio(f"stateful {n}", "stateful 1"),
                         "paged_vs_stateful": ratio(f"paged {n}", f"stateful {n}"),
                         "target": TARGETS.get(n, ALONE_TARGET if n == 1 else "")})
            if n in TARGETS:
                summary.append({"measure": f"{n} streams / 1 stream, paged, 2 stages", "model": model.name,
                                "value": f"{rows[-1]['paged_vs_paged_1']}x", "target": f">= {TARGETS[n]}x"})
        summary.append({"measure": "1 stream alone, paged / stateful", "model": model.name,
                        "value": f"{rows[-len(STREAMS)]['paged_vs_stateful']}x", "target": f">= {ALONE_TARGET}x"})
        raw[model.name] = {"samples": samples, "ticks": stats.ticks if stats else 0,
                           "rows_per_tick": round(stats.rows_per_tick, 2) if stats else 0,
                           "seqs_per_tick": round(stats.seqs_per_tick, 2) if stats else 0}
    return {
        "target": "aggregate decode tok/s on 2 stages: 2 streams >= 1.95x one stream, 8 >= 5x, 16 >= 7x; "
                  "one stream alone >= 0.97x the stateful path",
        "settings": {"threads_per_stage": THREADS_PER_STAGE, "rounds": bench.settings.rounds,
                     "transport": "loopback TCP, one worker process per stage (paged and stateful sets side by side)",
                     "sampling": "greedy, no speculation",
                     "new_tokens_per_stream": {m.name: bench.settings.tokens(m) for m in bench.models}},
        "rows": rows, "samples": raw, "summary": summary,
        "plot": {"group_by": "model", "label": "{streams} streams", "value": "paged_vs_paged_1",
                 "ylabel": "paged total tokens/s relative to one stream"},
    }


def _ttft(head: Head, prompt: list[int]) -> float:
    start = time.perf_counter()
    tokens = head.generate(prompt, SamplingConfig(max_tokens=2))
    next(tokens)
    elapsed = time.perf_counter() - start
    tokens.close()
    return elapsed


@scenario("q", "prefix reuse on paged stages: a chat history seen before, and 8 requests sharing a system prompt")
def prefix_reuse(bench: Bench) -> dict[str, Any]:
    rows, summary = [], []
    for model in bench.models:
        bundle = bench.bundle(model, 2)
        limit = read_manifest(bundle).runtime_hints.max_positions
        vocab = read_manifest(bundle).architecture.vocab_size
        history = [1 + (7 * i) % (vocab - 1) for i in range(min(2000, limit - 64))]
        with local_workers(bundle, threads=THREADS_PER_STAGE) as addresses:
            head = Head(bundle, addresses, timeout=600)
            try:
                ttft = {"unseen": [], "seen": []}
                for r in range(bench.settings.rounds):
                    turn = [*history[:-r - 1], 5 + r]  # a history no earlier round computed in full
                    ttft["unseen"].append(_ttft(head, turn))
                    ttft["seen"].append(_ttft(head, [*turn, 9, 10, 11, 12]))  # the next turn: 4 new tokens
                    progress(f"q: {model.name} history of {len(turn)}: first token {ttft['unseen'][-1]:.3f} s, "
                             f"seen {ttft['seen'][-1]:.3f} s")
                ratio = round(median([s / u for s, u in zip(ttft["seen"], ttft["unseen"], strict=True)]), 3)
                batcher = head.chain.batcher
                before = batcher.stats.blocks if batcher else None
                system = [1 + (11 * i) % (vocab - 1) for i in range(min(1000, limit // 2))]
                prompts = [[*system, 3 + i, 4 + i] for i in range(8)]
                _aggregate(head, prompts, 4, 8, None)
                after = batcher.stats.blocks if batcher else None
                hits = (after.hit_tokens - before.hit_tokens) if after and before else 0
            finally:
                head.close()
        shared = len(system) // 32 * 32
        rows.append({"model": model.name, "history_tokens": len(history), "ttft_unseen_s": round(median(ttft["unseen"]), 3),
                     "ttft_seen_s": round(median(ttft["seen"]), 3), "seen_vs_unseen": ratio,
                     "system_prompt_tokens": len(system), "prefix_hit_tokens_of_8": hits,
                     "prefilled_once": hits >= 7 * shared})
        summary += [{"measure": f"first token, a {len(history)}-token history seen before / unseen", "model": model.name,
                     "value": f"{ratio}x", "target": "<= 0.2x"},
                    {"measure": f"8 requests sharing a {len(system)}-token system prompt: cached tokens reused",
                     "model": model.name, "value": f"{hits} of {8 * len(system)} ({'once' if rows[-1]['prefilled_once'] else 'more than once'})",
                     "target": "prefilled once"}]
    return {"target": "a seen history's first token <= 0.2x an unseen one's; a shared system prompt prefilled once",
            "settings": {"threads_per_stage": THREADS_PER_STAGE, "rounds": bench.settings.rounds},
            "rows": rows, "summary": summary,
            "plot": {"group_by": "model", "label": "history", "value": "seen_vs_unseen",
                     "ylabel": "first token, seen / unseen history"}}
