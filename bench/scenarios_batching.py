"""Continuous batching: p (1, 2, 8, 16 concurrent streams on 2 stages over loopback TCP, paged workers that batch
every stream into one inference a tick vs stateful workers that step each stream alone; aggregate decode
tokens/s), q (prefix reuse: a shared system prompt, and a chat history seen before: time to first token) and t
(the first token of a 2,048-token prompt: one-shot prefill vs chunks pipelined over the stages)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

from scenarios_base import Bench, ModelSpec, median, progress, scenario
from scenarios_streams import _aggregate, _prompts

from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.ticks import tick_budget

STREAMS = (1, 2, 8, 16)
THREADS_PER_STAGE = 1  # one core per stage stands in for one machine per stage
TARGETS = {2: 1.95, 8: 5.0, 16: 7.0}  # aggregate tokens/s over one stream (paged)
ALONE_TARGET = 0.97  # one stream, paged / stateful
LONG_PROMPT = 2048  # tokens of a long prompt or chat history (q, t)
CHUNKS = (1024, 512, 256)  # prefill chunk sizes tried against one-shot (t)


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
            stats = heads["paged"].engine.stats if heads["paged"].engine else None

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


def _ttft(head: Head, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a greedy request, and that token."""
    start = time.perf_counter()
    tokens = head.generate(prompt, SamplingConfig(max_tokens=2))
    first = next(tokens)
    elapsed = time.perf_counter() - start
    tokens.close()
    return elapsed, first


def _long(model: ModelSpec) -> ModelSpec:
    """The model with room for LONG_PROMPT tokens (a synthetic shape takes any rotary table)."""
    return replace(model, max_positions=max(model.max_positions, 2 * LONG_PROMPT)) if model.synth_shape else model


def _text(vocab: int, n: int, salt: int) -> list[int]:
    """``n`` token ids after BOS, different for every ``salt`` from the first on (so no two share a block)."""
    return [1, *(2 + (7 * i + 13 * salt + salt * salt) % (vocab - 2) for i in range(n - 1))]


@scenario("q", "prefix reuse on paged stages: a chat history seen before, and 8 requests sharing a system prompt")
def prefix_reuse(bench: Bench) -> dict[str, Any]:
    rows, summary = [], []
    for model in bench.models:
        bundle = bench.bundle(_long(model), 2)
        manifest = read_manifest(bundle)
        vocab, size = manifest.architecture.vocab_size, min(LONG_PROMPT, manifest.runtime_hints.max_positions - 64)
        with local_workers(bundle, threads=THREADS_PER_STAGE) as addresses:
            head = Head(bundle, addresses, timeout=600)
            try:
                ttft: dict[str, list[float]] = {"unseen": [], "seen": []}
                for r in range(bench.settings.rounds):
                    turn = _text(vocab, size, salt=r + 1)  # a history no earlier request brought
                    ttft["unseen"].append(_ttft(head, turn)[0])
                    ttft["seen"].append(_ttft(head, [*turn, 9, 10, 11, 12])[0])  # the next turn: 4 new tokens
                    progress(f"q: {model.name} history of {len(turn)}: first token {ttft['unseen'][-1]:.3f} s, "
                             f"seen {ttft['seen'][-1]:.3f} s")
                ratio = round(median([s / u for s, u in zip(ttft["seen"], ttft["unseen"], strict=True)]), 3)
                engine = head.engine
                before = engine.stats.blocks if engine else None
                system = _text(vocab, size // 2, salt=99)
                _aggregate(head, [[*system, 3 + i, 4 + i] for i in range(8)], 4, 8, None)
                after = engine.stats.blocks if engine else None
                hits = (after.hit_tokens - before.hit_tokens) if after and before else 0
            finally:
                head.close()
        shared = len(system) // 32 * 32
        rows.append({"model": model.name, "history_tokens": size, "ttft_unseen_s": round(median(ttft["unseen"]), 3),
                     "ttft_seen_s": round(median(ttft["seen"]), 3), "seen_vs_unseen": ratio,
                     "system_prompt_tokens": len(system), "prefix_hit_tokens_of_8": hits,
                     "prefilled_once": hits >= 7 * shared})
        once = "once" if rows[-1]["prefilled_once"] else "more than once"
        summary += [{"measure": f"first token, a {size}-token history seen before / unseen", "model": model.name,
                     "value": f"{ratio}x", "target": "<= 0.2x"},
                    {"measure": f"8 requests sharing a {len(system)}-token system prompt: cached tokens reused",
                     "model": model.name, "value": f"{hits} of {8 * len(system)} ({once})", "target": "prefilled once"}]
    return {"target": "a seen history's first token <= 0.2x an unseen one's; a shared system prompt prefilled once",
            "settings": {"threads_per_stage": THREADS_PER_STAGE, "rounds": bench.settings.rounds},
            "rows": rows, "summary": summary,
            "plot": {"group_by": "model", "label": "history", "value": "seen_vs_unseen",
                     "ylabel": "first token, seen / unseen history"}}


@scenario("t", "time to the first token of a long prompt on 2 paged stages: one-shot vs chunks pipelined")
def chunked_ttft(bench: Bench) -> dict[str, Any]:
    rows, summary, raw = [], [], {}
    for model in bench.models:
        bundle = bench.bundle(_long(model), 2)
        manifest = read_manifest(bundle)
        size = min(LONG_PROMPT, manifest.runtime_hints.max_positions - 16)
        variants = {"one-shot": tick_budget(max_seqs=4, token_budget=size + 16)}
        variants.update({f"chunks of {c}": tick_budget(max_seqs=4, max_chunk=c) for c in CHUNKS if c < size})
        times: dict[str, list[float]] = {name: [] for name in variants}
        firsts: dict[str, set[int]] = {name: set() for name in variants}
        with local_workers(bundle, threads=THREADS_PER_STAGE) as addresses:
            blocks = 2 * (size // 32 + 2)  # each head's share of the pool: two prompts' worth
            heads = {name: Head(bundle, addresses, timeout=600, budget=config, kv_blocks=blocks)
                     for name, config in variants.items()}
            try:
                for r in range(bench.settings.rounds):
                    for i, (name, head) in enumerate(heads.items() if r % 2 == 0 else list(heads.items())[::-1]):
                        elapsed, first = _ttft(head, _text(manifest.architecture.vocab_size, size, salt=100 * r + i))
                        times[name].append(elapsed)
                        firsts[name].add(first)
                        progress(f"t: {model.name} {size} tokens, {name}: {elapsed:.3f} s")
            finally:
                for head in heads.values():
                    head.close()
        base = times["one-shot"]
        for name in variants:
            speedup = round(median([b / t for b, t in zip(base, times[name], strict=True)]), 2)
            rows.append({"model": model.name, "prompt_tokens": size, "variant": name,
                         "ttft_s": round(median(times[name]), 3), "speedup_vs_one_shot": speedup})
        best = max(rows[-len(variants):], key=lambda row: row["speedup_vs_one_shot"])
        summary.append({"measure": f"first token of a {size}-token prompt, {best['variant']} / one-shot, 2 stages",
                        "model": model.name, "value": f"{best['speedup_vs_one_shot']}x faster", "target": ">= 1.5x"})
        raw[model.name] = times
    return {"target": "first token of a 2,048-token prompt on 2 stages >= 1.5x faster than one-shot prefill",
            "settings": {"threads_per_stage": THREADS_PER_STAGE, "rounds": bench.settings.rounds,
                         "note": "each request a prompt no other brought (no prefix hits); default hints"},
            "rows": rows, "summary": summary, "samples": raw,
            "plot": {"group_by": "model", "label": "{variant}", "value": "speedup_vs_one_shot",
                     "ylabel": "first-token speed-up over one-shot prefill"}}
