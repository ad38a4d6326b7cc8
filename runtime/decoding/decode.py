"""The decode loop: plain or speculative, over any target that runs tokens through every stage.

Each step sends the tokens not yet in the cache (the prompt first, then the last accepted token) plus
K drafted tokens through the pipeline in one traversal, and reads back K+1 rows. The accept rule
(greedy or speculative sampling, see speculative.py) keeps a prefix of the drafts and adds one token
of the target's own. The rejected drafts are hidden in every stage's cache by the *next* Step's
``rewind`` (mask zeroing, which travels with that Step so every stage applies it in order), and the
next position id continues from the logical length. With no drafter, K = 0 and this is plain decoding.

A target is anything with ``step(tokens, position, want, rewind, compact) -> Scores``,
``max_positions`` and ``vocab_size``: the reference LocalPipeline (client/inprocess.py) that ``verify`` and the
tests compare with. Every command produces its tokens with the engine loop instead (scheduling/engine.py), over
workers or over the stages in this process, stateful stages included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ovshard.errors import OvshardError
from ovshard.runtime.decoding.speculative import Speculation, accept
from ovshard.runtime.engine.kv import CacheMask, CompactionPolicy
from ovshard.runtime.engine.sampler import SamplingConfig, make_rng, should_stop
from ovshard.runtime.engine.scores import Scores


def want_for(config: SamplingConfig, rows: int) -> str:
    """The least a last stage must send for ``rows`` rows under this sampling config."""
    if config.greedy:
        mode = "argmax"
    elif config.top_k > 0 and config.top_p == 1:
        mode = f"topk:{config.top_k}"
    else:
        mode = "logits"
    return mode if rows == 1 and mode != "argmax" else f"{mode}@{rows}"


class Target(Protocol):
    max_positions: int
    vocab_size: int

    def step(self, tokens: list[int], position: int, want: str, rewind: int, compact: bool) -> Scores: ...


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float = 0.0
    total_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # head-measured round trip of each step
    stage_s: list[dict[str, float]] = field(default_factory=list)  # each stage's compute per step
    step_tokens: list[int] = field(default_factory=list)  # tokens each step produced
    draft_s: float = 0.0
    speculative: str = "off"
    drafted: int = 0
    accepted: int = 0
    k_chosen: list[int] = field(default_factory=list)
    rewinds: int = 0  # these three are the stream's CacheMask counters, copied after each step
    rewound_positions: int = 0
    compactions: int = 0
    finish_reason: str = ""  # "stop" (an eos id), "length" (max_tokens or the context is full); "" while running
    replays: int = 0  # times the stream was replayed into fresh streams after a stage failure
    cached_tokens: int = 0  # prompt tokens whose KV the stages held already (a prefix seen before)
    hops: int = 0  # links a step crosses, the target's ``hops``; 0: stages + 1 (head -> stage 0 -> ... -> head)

    def to_dict(self) -> dict:
        """Decode-phase figures (the first step, the prefill, is in time_to_first_token_s).

        per-hop network ms = (step round trip - sum of stage compute) / hops, hops = stages + 1
        (head -> stage 0 -> ... -> last -> head): transfer, serialisation and waiting; a target in this
        process counts 1, so it is all a step costs beyond compute (the sampler, Python).
        """
        decode, stages = self.step_s[1:], self.stage_s[1:]
        report: dict = {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                        "finish_reason": self.finish_reason, "time_to_first_token_s": round(self.first_token_s, 4)}
        if self.replays:
            report["replays"] = self.replays
        if self.cached_tokens:
            report["cached_tokens"] = self.cached_tokens
        if decode:
            compute = [sum(s.values()) for s in stages]
            hops = self.hops or len(stages[0]) + 1
            report["decode_tokens_per_s"] = round(sum(self.step_tokens[1:]) / (sum(decode) + self.draft_s), 2)
            report["mean_step_ms"] = round(1000 * float(np.mean(decode)), 3)
            for name in stages[0]:
                report[f"{name}_compute_ms"] = round(1000 * float(np.mean([s[name] for s in stages])), 3)
            report["per_hop_network_ms"] = round(1000 * float(np.mean(decode) - np.mean(compute)) / hops, 3)
        if self.speculative != "off":
            steps = len(self.step_s)
            report.update({
                "speculative": self.speculative,
                "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
                "mean_accepted_per_step": round(self.accepted / steps, 3) if steps else 0.0,
                "tokens_per_step": round(self.new_tokens / steps, 3) if steps else 0.0,
                "mean_k": round(float(np.mean(self.k_chosen)), 2) if self.k_chosen else 0.0,
                "rewinds": self.rewinds,
                "rewound_positions": self.rewound_positions,
                "compactions": self.compactions,
            })
        return report


def generate(target: Target, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
             speculation: Speculation | None = None) -> Iterator[int]:
    """Yield tokens until an eos id or max_tokens; plain decoding when ``speculation`` is None."""
    stats = stats if stats is not None else Stats()
    speculation = speculation.fresh() if speculation else None
    rng = make_rng(config)
    policy = speculation.policy if speculation else CompactionPolicy(limit=target.max_positions)
    if speculation:
        stats.speculative = speculation.name
    stats.prompt_tokens = len(prompt)
    stats.hops = getattr(target, "hops", 0)
    start = time.perf_counter()
    try:
        yield from _loop(target, prompt, config, stats, speculation, policy, rng, start)
    finally:
        stats.total_s = time.perf_counter() - start


def _loop(target: Target, prompt: list[int], config: SamplingConfig, stats: Stats,
          speculation: Speculation | None, policy: CompactionPolicy, rng: np.random.Generator,
          start: float) -> Iterator[int]:
    book = CacheMask()  # a mirror of every stage's mask for this stream
    history, pending, rewind = list(prompt), list(prompt), 0
    tokens: list[int] = []
    while True:
        if book.visible + len(pending) > target.max_positions:
            if not tokens:
                raise OvshardError(f"the prompt has {len(prompt)} tokens; this bundle serves at most "
                                   f"{target.max_positions} positions (compile with a larger --max-positions)")
            stats.finish_reason = "length"  # the context is full
            return
        room = min(config.max_tokens - len(tokens) - 1, target.max_positions - book.visible - len(pending))
        drafts: list[int] = []
        q: list[np.ndarray] | None = None
        draft_s = 0.0
        if speculation and room > 0:
            t0 = time.perf_counter()
            k = min(speculation.choose_k(), room)
            drafts, q = speculation.drafter.draft(history, k, config, rng)
            draft_s = time.perf_counter() - t0
            stats.draft_s += draft_s if tokens else 0.0
            stats.k_chosen.append(k)
        feed = pending + list(drafts)
        compact = policy.wants(book, len(feed))
        t0 = time.perf_counter()
        scores = target.step(feed, book.visible, want_for(config, len(drafts) + 1), rewind, compact)
        elapsed = time.perf_counter() - t0
        stats.replays = getattr(target, "replays", 0)
        if compact:
            book.compact()
        book.append([1] * len(feed))
        new = accept(drafts, q, scores, config, rng, target.vocab_size)
        rewind = len(drafts) - (len(new) - 1)
        book.rewind(rewind)
        stats.step_s.append(elapsed)
        stats.stage_s.append(dict(scores.timings))
        stats.drafted += len(drafts)
        stats.accepted += len(new) - 1
        stats.rewinds, stats.rewound_positions, stats.compactions = book.rewinds, book.hidden, book.compactions
        if speculation:
            speculation.observe(len(drafts), len(new) - 1, elapsed, len(feed), draft_s)
        if not tokens:
            stats.first_token_s = time.perf_counter() - start
            stats.cached_tokens = getattr(target, "cached_tokens", 0)
        produced = 0
        for token in new:
            tokens.append(token)
            produced += 1
            stats.new_tokens = len(tokens)
            yield token
            if should_stop(tokens, config):
                stats.step_tokens.append(produced)
                stats.finish_reason = "stop" if token in config.eos_token_ids else "length"
                return
        stats.step_tokens.append(produced)
        history += new
        pending = [new[-1]]

