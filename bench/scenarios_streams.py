"""Stream scenarios: d (1, 2, 4 concurrent streams on 2 and 4 stages: total tokens/s) and e (per-hop
latency 0-100 ms through delaying proxies: naive pipeline decode vs streams + speculation)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from scenarios_base import MODELS, Bench, median, progress, scenario

from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.decoding.speculative import AutoK, PromptLookup, Speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.tools.wanproxy import DelayProxy

STREAMS = (1, 2, 4)
STAGES = (2, 4)
LATENCIES_MS = (0, 10, 50, 100)
FULL_STACK_STREAMS = (4, 8)
THREADS_PER_STAGE = 1  # 2 cores here: one core per stage stands in for one machine per stage
SCALING_TARGET = 1.9  # 2 streams on 2 stages / 1 stream (the paper: 1.80x)
WAN_TARGET = 6.0  # full stack / naive at 100 ms per hop (the paper: 4.04x)

# Distinct prompts (ids in each model's vocabulary) so streams do different work.
PROMPTS = {
    "stories260K": [[1, 403, 407, 261, 378], [1, 365, 261, 466, 14], [1, 92, 388, 17], [1, 261, 378, 261, 403],
                    [1, 14, 92, 14, 365], [1, 466, 14, 92], [1, 378, 259, 403], [1, 407, 261, 17, 92]],
}


def _prompts(model_name: str, prompt: tuple[int, ...], n: int) -> list[list[int]]:
    if model_name in PROMPTS:
        return (PROMPTS[model_name] * n)[:n]
    return [list(prompt[:-i or None]) if i else list(prompt) for i in range(n)]  # prefixes of one prompt


def _aggregate(head: Head, prompts: list[list[int]], tokens: int, streams: int,
               speculation: Speculation | None) -> dict[str, float]:
    """All prompts over ``streams`` concurrent streams: total new tokens / wall seconds."""
    session = Scheduler(head, streams, speculation)
    start = time.perf_counter()
    try:
        requests = session.run_all(prompts, SamplingConfig(max_tokens=tokens))
    finally:
        session.close()
    wall = time.perf_counter() - start
    failed = [r.error for r in requests if r.error is not None]
    if failed:
        raise failed[0]
    total = sum(r.stats.new_tokens for r in requests)
    accepted = sum(r.stats.accepted for r in requests)
    drafted = sum(r.stats.drafted for r in requests)
    return {"tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "acceptance": accepted / drafted if drafted else 0.0}


@scenario("d", "1, 2, 4 concurrent streams on 2 and 4 stages over loopback TCP: total tokens/s")
def stream_scaling(bench: Bench) -> dict[str, Any]:
    rows, raw = [], {}
    for model in bench.models:
        tokens = bench.settings.tokens(model)
        for stages in STAGES:
            bundle = bench.bundle(model, stages)  # the planner's split: --balance reads, its default
            split = ",".join(f"{e.stage.start}:{e.stage.end}" for e in read_manifest(bundle).stages)
            samples: dict[int, list[dict[str, float]]] = {n: [] for n in STREAMS}
            with local_workers(bundle, threads=THREADS_PER_STAGE) as addresses:
                head = Head(bundle, addresses)
                try:
                    _aggregate(head, _prompts(model.name, model.prompt, 1), 8, 1, None)  # warm-up
                    for r in range(bench.settings.rounds):
                        order = STREAMS if r % 2 == 0 else STREAMS[::-1]
                        for n in order:
                            samples[n].append(_aggregate(head, _prompts(model.name, model.prompt, n), tokens, n,
                                                         None))
                            progress(f"d: {model.name} {stages} stages, {n} streams: "
                                     f"{samples[n][-1]['tokens_per_s']:.1f} tok/s")
                finally:
                    head.close()
            for n in STREAMS:
                ratios = [s["tokens_per_s"] / b["tokens_per_s"] for s, b in zip(samples[n], samples[1], strict=True)]
                rows.append({"model": model.name, "stages": stages, "layers": split, "streams": n,
                             "total_tok_s": round(median([s["tokens_per_s"] for s in samples[n]]), 2),
                             "vs_1_stream": round(median(ratios), 2),
                             "target": SCALING_TARGET if (stages, n) == (2, 2) else ""})
            raw[f"{model.name}/{stages}"] = {str(n): v for n, v in samples.items()}
    return {
        "target": f"2 streams on 2 stages >= {SCALING_TARGET}x one stream (the paper: 1.80x)",
        "settings": {"threads_per_stage": THREADS_PER_STAGE, "rounds": bench.settings.rounds,
                     "split": "the planner's default (--balance reads: bytes a decode step reads)",
                     "transport": "loopback TCP, one worker process per stage", "sampling": "greedy, no speculation",
                     "new_tokens_per_stream": {m.name: bench.settings.tokens(m) for m in bench.models}},
        "rows": rows, "samples": raw,
        "summary": [{"measure": f"{r['streams']} streams / 1 stream on {r['stages']} stages, total tok/s",
                     "model": r["model"], "value": f"{r['vs_1_stream']}x",
                     "target": f">= {r['target']}x" if r["target"] else ""} for r in rows if r["streams"] > 1],
        "plot": {"group_by": "model", "label": "{stages} stages, {streams} streams", "value": "vs_1_stream",
                 "ylabel": "total tokens/s relative to one stream"},
    }


def _behind_proxies(stack: ExitStack, addresses: list[str], latency_s: float) -> list[str]:
    proxied = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        proxy = stack.enter_context(DelayProxy(target=(host, int(port)), latency_s=latency_s))
        proxied.append(proxy.address)
    return proxied


@scenario("e", "per-hop latency 0-100 ms (delaying proxies): naive pipeline decode vs streams + speculation")
def wan_latency(bench: Bench) -> dict[str, Any]:
    model = MODELS["stories260K"]
    bundle: Path = bench.bundle(model, 2)
    manifest = read_manifest(bundle)
    tokens = max(24, bench.settings.tokens(model) // 4)
    rounds = min(bench.settings.rounds, 2)
    policy = CompactionPolicy(limit=manifest.runtime_hints.max_positions)
    rows, raw = [], {}
    with local_workers(bundle, threads=THREADS_PER_STAGE) as addresses:
        for latency_ms in LATENCIES_MS:
            with ExitStack() as stack:
                head = Head(bundle, _behind_proxies(stack, addresses, latency_ms / 1000), timeout=120)
                stack.callback(head.close)
                samples: dict[str, list[dict[str, float]]] = {"naive": []}
                samples.update({f"full {n} streams": [] for n in FULL_STACK_STREAMS})
                for r in range(rounds):
                    samples["naive"].append(_aggregate(head, _prompts(model.name, model.prompt, 1), tokens, 1, None))
                    for n in FULL_STACK_STREAMS:
                        spec = Speculation(PromptLookup(), AutoK(), policy)
                        samples[f"full {n} streams"].append(
                            _aggregate(head, _prompts(model.name, model.prompt, n), tokens, n, spec))
                    progress(f"e: {latency_ms} ms/hop round {r + 1}: " + ", ".join(
                        f"{k} {v[-1]['tokens_per_s']:.1f} tok/s" for k, v in samples.items()))
            for n in FULL_STACK_STREAMS:
                full = samples[f"full {n} streams"]
                ratios = [f["tokens_per_s"] / b["tokens_per_s"] for f, b in zip(full, samples["naive"], strict=True)]
                rows.append({"latency_ms_per_hop": latency_ms, "streams": n, "full_stack": f"{n} streams + speculation",
                             "naive_tok_s": round(median([s["tokens_per_s"] for s in samples["naive"]]), 2),
                             "full_stack_tok_s": round(median([s["tokens_per_s"] for s in full]), 2),
                             "ratio": round(median(ratios), 2),
                             "acceptance": round(median([s["acceptance"] for s in full]), 3),
                             "target": WAN_TARGET if latency_ms == 100 else ""})
            raw[str(latency_ms)] = samples
    return {
        "target": f"at 100 ms per hop the full stack >= {WAN_TARGET}x naive (the paper: 4.04x)",
        "settings": {"model": model.name, "stages": 2, "hops_per_step": 3, "new_tokens_per_stream": tokens,
                     "rounds": rounds, "threads_per_stage": THREADS_PER_STAGE,
                     "naive": "1 stream, plain greedy", "full stack": "N streams, prompt lookup, K auto",
                     "proxy": "ovshard.runtime.tools.wanproxy.DelayProxy in front of every stage, both directions"},
        "rows": rows, "samples": raw,
        "summary": [{"measure": f"{r['latency_ms_per_hop']} ms/hop: full stack ({r['streams']} streams) / naive",
                     "model": model.name, "value": f"{r['ratio']}x",
                     "target": f">= {r['target']}x" if r["target"] else ""} for r in rows],
        "plot": {"group_by": "full_stack", "label": "{latency_ms_per_hop} ms per hop", "value": "ratio",
                 "ylabel": "full stack / naive tokens per second"},
    }
