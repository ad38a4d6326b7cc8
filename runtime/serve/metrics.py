"""Prometheus metrics of an API server (``GET /metrics``), in a registry of its own.

    ovshard_requests_total{endpoint, status}       requests answered, by endpoint and HTTP status
    ovshard_prompt_tokens_total                    prompt tokens fed
    ovshard_generated_tokens_total                 tokens generated
    ovshard_time_to_first_token_seconds            histogram: request received -> first token
    ovshard_inter_token_latency_seconds            histogram: between consecutive tokens of a request
    ovshard_stage_compute_seconds{stage}           histogram: one stage's compute per decode step
    ovshard_hop_network_seconds                    histogram: per-hop network time per decode step
    ovshard_speculative_drafted_total / _accepted_total   draft tokens proposed and accepted
    ovshard_queue_depth                            requests waiting to start
    ovshard_active_streams                         requests running

and, over paged stages (continuous batching; scheduling/engine.py, counted since the head's last (re)connect):

    ovshard_batch_ticks_total                      inferences (ticks) sent through the pipeline
    ovshard_batch_rows_total                       token rows over those ticks (tokens per tick = rows / ticks)
    ovshard_batch_sequence_rows_total              sequences over those ticks (rows per tick per sequence)
    ovshard_batch_last_rows / _last_sequences      the latest tick's rows and sequences
    ovshard_kv_blocks{state}                       KV blocks: used (held by a sequence), cached (a prefix
                                                   kept for reuse), free
    ovshard_batch_sequences{state}                 sequences the engine's planner holds: running (KV blocks held),
                                                   waiting (for blocks, or preempted)
    ovshard_prefix_lookup_tokens_total             prompt tokens looked up in the prefix cache
    ovshard_prefix_hit_tokens_total                of those, found computed (hit rate = hit / lookup)
    ovshard_preemptions_total                      sequences preempted (a full pool), recomputed later

and, where the stages may move (``ovshard up`` re-plans when a node leaves or joins):

    ovshard_replans_total{outcome}                 re-plans: "moved" (the head serves a new chain), "refused"
                                                   (what is left cannot hold the model: 503 until a node joins)
    ovshard_replayed_tokens_total                  tokens fed again to rebuild the KV cache of streams whose
                                                   chain broke (a stage restarted or moved)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.scheduling.tick_planner import PlannerStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _PlannerCollector:
    """The engine's planner counters, read when /metrics is scraped."""

    def __init__(self, planner: Callable[[], PlannerStats | None]) -> None:
        self.planner = planner

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.planner()
        if stats is None:
            return
        for name, text, value in (("batch_ticks", "Inferences (ticks) sent through the pipeline", stats.ticks),
                                  ("batch_rows", "Token rows over all ticks", stats.rows),
                                  ("batch_sequence_rows", "Sequences over all ticks", stats.seqs),
                                  ("prefix_lookup_tokens", "Prompt tokens looked up in the prefix cache",
                                   stats.blocks.lookup_tokens),
                                  ("prefix_hit_tokens", "Prompt tokens found computed in the prefix cache",
                                   stats.blocks.hit_tokens),
                                  ("preemptions", "Sequences preempted by a full KV pool", stats.preemptions)):
            yield CounterMetricFamily(f"ovshard_{name}", text, value=value)
        yield GaugeMetricFamily("ovshard_batch_last_rows", "Rows of the latest tick", value=stats.last_rows)
        yield GaugeMetricFamily("ovshard_batch_last_sequences", "Sequences of the latest tick", value=stats.last_seqs)
        blocks = GaugeMetricFamily("ovshard_kv_blocks", "KV blocks by state", labels=["state"])
        for state, value in (("used", stats.blocks.used), ("cached", stats.blocks.cached), ("free", stats.blocks.free)):
            blocks.add_metric([state], value)
        yield blocks
        seqs = GaugeMetricFamily("ovshard_batch_sequences", "Sequences the engine's planner holds by state", labels=["state"])
        seqs.add_metric(["running"], stats.running)
        seqs.add_metric(["waiting"], stats.waiting)
        yield seqs


class _MoveCollector:
    """The head's re-plans and replayed tokens, read when /metrics is scraped."""

    def __init__(self, moves: Callable[[], tuple[int, int, int]]) -> None:
        self.moves = moves  # () -> (moved, refused, replayed tokens)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        moved, refused, replayed = self.moves()
        replans = CounterMetricFamily("ovshard_replans", "Re-plans of the stages by outcome", labels=["outcome"])
        replans.add_metric(["moved"], moved)
        replans.add_metric(["refused"], refused)
        yield replans
        yield CounterMetricFamily("ovshard_replayed_tokens", "Tokens fed again to rebuild streams' KV caches",
                                  value=replayed)


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], active: Callable[[], int],
                 planner: Callable[[], PlannerStats | None] | None = None,
                 moves: Callable[[], tuple[int, int, int]] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ovshard_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ovshard_prompt_tokens", "Prompt tokens fed", registry=r)
        self.generated = Counter("ovshard_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ovshard_time_to_first_token_seconds", "Request received to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ovshard_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("ovshard_stage_compute_seconds", "A stage's compute per decode step", ["stage"],
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.hop = Histogram("ovshard_hop_network_seconds", "Per-hop network time per decode step",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.drafted = Counter("ovshard_speculative_drafted", "Draft tokens proposed", registry=r)
        self.accepted = Counter("ovshard_speculative_accepted", "Draft tokens accepted", registry=r)
        Gauge("ovshard_queue_depth", "Requests waiting to start", registry=r).set_function(queue_depth)
        Gauge("ovshard_active_streams", "Requests running", registry=r).set_function(active)
        if planner is not None:
            r.register(_PlannerCollector(planner))
        if moves is not None:
            r.register(_MoveCollector(moves))

    def observe(self, stats: Stats) -> None:
        """One finished request's figures."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for step_s, stages in zip(stats.step_s[1:], stats.stage_s[1:], strict=False):
            for name, seconds in stages.items():
                self.stage.labels(name.removeprefix("stage")).observe(seconds)
            if stages:
                self.hop.observe(max(0.0, step_s - sum(stages.values())) / (len(stages) + 1))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
