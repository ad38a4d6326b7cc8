"""The partition planner: cut a model's block chain into contiguous pipeline stages at layer boundaries.

The model is a networkx chain ``embed -> layer.0 -> ... -> layer.{L-1} -> head``; only edges between two
layers are cuttable. Stage 0 carries the embedding, the last stage the head. Layer ranges are half-open.
Every planner solves the chain exactly by dynamic programming over the cut positions (O(stages * L^2)).
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import networkx as nx

from ovshard.bundle.plan import PartitionPlan, StagePlan, format_bytes, format_range
from ovshard.bundle.stage import StageSpec
from ovshard.errors import PlanError

# size suffixes, lower-cased: kb = 1000 bytes, kib = 1024 bytes, ... up to tb / tib; none or "b" = bytes
_UNITS = {"": 1, "b": 1} | {
    f"{p}{i}b": base**e for e, p in enumerate("kmgt", 1) for i, base in (("", 1000), ("i", 1024))
}
_BYTES_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")
_RANGE_RE = re.compile(r"(\d+):(\d+)")
Ranges = Sequence[tuple[int, int]]  # half-open [start, end) layer ranges, one a stage


@dataclass(frozen=True)
class Block:
    """One unit of the chain: the embedding, one decoder layer, or the head (final norm + lm_head)."""

    name: str  # "embed", "layer.0", ..., "layer.{L-1}", "head"
    kind: str  # "embed" | "layer" | "head"
    layer: int | None  # layer index when kind == "layer"
    weight_bytes: int  # after the chosen weight compression
    kv_bytes_per_token: int  # KV cache added per token of context (0 for embed and head)
    read_bytes: int | None = None  # weight bytes a decode step reads; None: all of them (the embedding: a row)
    kv_reach: int | None = None  # cached positions a step's attention reads at most (a sliding window); None: all


@dataclass(frozen=True)
class ModelCosts:
    """The blocks of a model in chain order and the bytes per token crossing any layer-boundary cut."""

    blocks: tuple[Block, ...]  # embed, layer.0 .. layer.L-1, head
    activation_bytes_per_token: int  # hidden_size * wire bytes
    shared_head_bytes: int = 0  # of the head's bytes, those a stage holding the embedding too stores once (tied)
    stage_bytes: int = 0  # every stage holds these whatever its layers (its rotary tables)

    def __post_init__(self) -> None:
        found = [(b.name, b.kind, b.layer) for b in self.blocks]
        layers = [(f"layer.{i}", "layer", i) for i in range(len(found) - 2)]
        if len(found) < 3 or found != [("embed", "embed", None), *layers, ("head", "head", None)]:
            raise PlanError(
                f"expected blocks (name, kind, layer) embed, layer.0 .. layer.N-1, head with N >= 1; "
                f"found {found}; build ModelCosts from the blocks in chain order"
            )

    @property
    def num_layers(self) -> int:
        return len(self.blocks) - 2


def build_block_graph(costs: ModelCosts) -> nx.DiGraph:
    """The block chain as a DiGraph; only edges between two layers are ``cuttable``."""
    graph = nx.DiGraph()
    for b in costs.blocks:
        graph.add_node(b.name, **{k: v for k, v in asdict(b).items() if k != "name"})
    for u, v in itertools.pairwise(costs.blocks):
        cuttable = u.kind == "layer" and v.kind == "layer"
        graph.add_edge(
            u.name, v.name, activation_bytes_per_token=costs.activation_bytes_per_token, cuttable=cuttable
        )
    return graph


@dataclass(frozen=True)
class _Chain:
    """Prefix sums over the graph's layers in topological order, so any stage costs O(1)."""

    weight_prefix: tuple[int, ...]  # [L + 1]
    read_prefix: tuple[int, ...]  # [L + 1] weight bytes a decode step reads
    kv_prefix: tuple[int, ...]  # [L + 1]
    embed: tuple[int, int]  # (weight_bytes, kv_bytes_per_token)
    head: tuple[int, int]
    cut_bytes: tuple[int, ...]  # [L + 1] activation bytes per token of the cut before layer i; 0 at 0 and L
    shared_head_bytes: int = 0
    stage_bytes: int = 0
    embed_read: int = 0
    head_read: int = 0
    kv_reach: tuple[int | None, ...] = ()  # [L] Block.kv_reach

    def kv_reads(self, context: int) -> tuple[int, ...]:
        """[L + 1] prefix sums of the KV bytes a decode step's attention reads in each layer for one sequence of
        ``context`` tokens: every cached position, or the layer's window of them."""
        per_layer = ((after - before) * (context if reach is None else min(context, reach))
                     for (before, after), reach in zip(itertools.pairwise(self.kv_prefix), self.kv_reach, strict=True))
        return tuple(itertools.accumulate(per_layer, initial=0))

    def reads(self, index: int, count: int, start: int, end: int, kv_reads: Sequence[int] | None = None) -> int:
        """Bytes stage ``index`` of ``count`` reads per decode step: its layers' weights, the lm_head in the
        last stage, the embedding's one row in the first (what a step's time follows, not bytes held), and, given
        ``kv_reads`` (``kv_reads(context)``), its layers' KV cache of one sequence at that context."""
        read = self.read_prefix[end] - self.read_prefix[start]
        if kv_reads is not None:
            read += kv_reads[end] - kv_reads[start]
        if index == 0:
            read += self.embed_read
        if index == count - 1:
            read += self.head_read
        return read

    def stage(self, index: int, count: int, start: int, end: int, ctx: int, budget: int | None) -> StagePlan:
        weight = self.weight_prefix[end] - self.weight_prefix[start] + self.stage_bytes
        kv = self.kv_prefix[end] - self.kv_prefix[start]
        if index == 0:
            weight, kv = weight + self.embed[0], kv + self.embed[1]
        if index == count - 1:
            weight, kv = weight + self.head[0], kv + self.head[1]
        if count == 1:  # one stage holds a tied embedding and lm_head as one constant
            weight -= self.shared_head_bytes
        return StagePlan(StageSpec(index, count, start, end), weight, kv, weight + kv * ctx, budget,
                         self.cut_bytes[start])


def _chain(costs: ModelCosts) -> _Chain:
    graph = build_block_graph(costs)
    order = list(nx.topological_sort(graph))
    attrs = [graph.nodes[n] for n in order]
    layers = attrs[1:-1]
    cut_bytes = [0] * (len(layers) + 1)
    for u, v in itertools.pairwise(order):
        if graph.edges[u, v]["cuttable"]:
            cut_bytes[graph.nodes[v]["layer"]] = graph.edges[u, v]["activation_bytes_per_token"]
    return _Chain(
        weight_prefix=tuple(itertools.accumulate((a["weight_bytes"] for a in layers), initial=0)),
        read_prefix=tuple(itertools.accumulate((_read(a) for a in layers), initial=0)),
        kv_prefix=tuple(itertools.accumulate((a["kv_bytes_per_token"] for a in layers), initial=0)),
        embed=(attrs[0]["weight_bytes"], attrs[0]["kv_bytes_per_token"]),
        head=(attrs[-1]["weight_bytes"], attrs[-1]["kv_bytes_per_token"]),
        cut_bytes=tuple(cut_bytes),
        shared_head_bytes=costs.shared_head_bytes,
        stage_bytes=costs.stage_bytes,
        embed_read=_read(attrs[0]),
        head_read=_read(attrs[-1]),
        kv_reach=tuple(a.get("kv_reach") for a in layers),
    )


def _read(attrs: dict) -> int:
    return attrs["weight_bytes"] if attrs.get("read_bytes") is None else attrs["read_bytes"]


_Score = Callable[[int, int, int], Any]  # (stage, start, end) -> comparable score, or None when not allowed


def _solve(
    num_layers: int, num_stages: int, score: _Score, combine: Callable[[Any, Any], Any]
) -> tuple[Any, list[tuple[int, int]]]:
    """Best ``combine`` of stage scores over every split, and its ranges with the smallest cuts among ties.

    ``best[i][a]`` is the best score for layers [a, L) on stages i..n-1; None when no split is allowed.
    """
    n, size = num_stages, num_layers

    def options(i: int, a: int, best: list[list[Any]]) -> list[tuple[int, Any]]:
        """(end, score) for each allowed end b of stage i starting at a; later stages need a layer each."""
        if i == n - 1:
            s = score(i, a, size)
            return [] if s is None else [(size, s)]
        out = []
        for b in range(a + 1, size - (n - 1 - i) + 1):
            s, rest = score(i, a, b), best[i + 1][b]
            if s is not None and rest is not None:
                out.append((b, combine(s, rest)))
        return out

    best: list[list[Any]] = [[None] * (size + 1) for _ in range(n)]
    for i in range(n - 1, -1, -1):
        for a in range(i, size - (n - i) + 1):
            best[i][a] = min((v for _, v in options(i, a, best)), default=None)
    if best[0][0] is None:
        return None, []
    ranges, a = [], 0
    for i in range(n):
        b = next(b for b, v in options(i, a, best) if v == best[i][a])  # smallest end reaching the optimum
        ranges.append((a, b))
        a = b
    return best[0][0], ranges


def optimal_ranges(num_layers: int, num_stages: int, cost: _Score, spread: _Score) -> tuple[Any, list]:
    """Minimise the largest stage cost; among optima minimise the summed spread, then the cut positions."""
    bound, _ = _solve(num_layers, num_stages, cost, max)
    _, ranges = _solve(
        num_layers,
        num_stages,
        lambda i, a, b: spread(i, a, b) if (c := cost(i, a, b)) is not None and c <= bound else None,
        operator.add,
    )
    return bound, ranges


def _check_request(costs: ModelCosts, num_stages: int, context_tokens: int) -> None:
    if not 1 <= num_stages <= costs.num_layers:
        raise PlanError(
            f"asked for {num_stages} stages but the model has {costs.num_layers} layers; each stage "
            f"needs at least one layer: use --stages {costs.num_layers} or fewer (and at least 1)"
        )
    if context_tokens < 0:
        raise PlanError(
            f"expected context_tokens >= 0, found {context_tokens}; pass the context to size KV for"
        )


def _make_plan(
    chain: _Chain, strategy: str, ranges: Ranges, ctx: int, budgets: Sequence[int] = ()
) -> PartitionPlan:
    stages = tuple(
        chain.stage(i, len(ranges), a, b, ctx, budgets[i] if budgets else None)
        for i, (a, b) in enumerate(ranges)
    )
    return PartitionPlan(strategy=strategy, context_tokens=ctx, stages=stages)


BALANCES = ("reads", "memory")


def plan_balanced(costs: ModelCosts, num_stages: int, context_tokens: int = 4096,
                  balance: str = "reads", read_context: int | None = None) -> PartitionPlan:
    """``balance="reads"`` (default): minimise the largest stage's bytes read per decode step (its step time:
    the lm_head counts in the last stage, the embedding's gathered rows hardly at all, and each layer's KV cache
    of one sequence at ``read_context`` tokens, by default ``context_tokens``); ``"memory"``: the largest stage
    memory (weights + KV cache). Ties: the smallest sum of squares, then the smallest cuts."""
    _check_request(costs, num_stages, context_tokens)
    _check_balance(balance)
    chain = _chain(costs)

    def memory(i: int, a: int, b: int) -> int:
        return chain.stage(i, num_stages, a, b, context_tokens, None).memory_bytes

    kv = chain.kv_reads(context_tokens if read_context is None else read_context)

    def reads(i: int, a: int, b: int) -> int:
        return chain.reads(i, num_stages, a, b, kv)

    cost = reads if balance == "reads" else memory
    _, ranges = optimal_ranges(costs.num_layers, num_stages, cost, lambda i, a, b: cost(i, a, b) ** 2)
    return _make_plan(chain, "balanced" if balance == "memory" else "balanced-reads", ranges, context_tokens)


def _check_balance(balance: str) -> None:
    if balance not in BALANCES:
        raise PlanError(f"--balance {balance!r}: expected reads (each stage's bytes read per decode step) or "
                        "memory (each stage's weights and KV cache)")


def plan_layers(costs: ModelCosts, ranges: Ranges, context_tokens: int = 4096) -> PartitionPlan:
    """Use the given ranges, which must tile [0, L) in order with non-empty ranges."""
    _check_ranges(ranges, costs.num_layers)
    _check_request(costs, len(ranges), context_tokens)
    return _make_plan(_chain(costs), "layers", [(a, b) for a, b in ranges], context_tokens)


def _check_ranges(ranges: Ranges, size: int) -> None:
    """Raise PlanError naming the first range that does not continue an in-order tiling of [0, size)."""
    fix = f"; the ranges must tile [0, {size}) in order, each starting where the previous one ended"
    prev_end = 0
    for k, (a, b) in enumerate(ranges):
        r = f"range {k} {format_range((a, b))}"
        if a >= b:
            raise PlanError(f"{r} holds no layers: expected start < end{fix}")
        if a != prev_end:
            lost = (
                f"[{prev_end}, {a}) are in no stage"
                if a > prev_end
                else f"[{a}, {prev_end}) are in two stages"
            )
            raise PlanError(f"{r} starts at layer {a}, expected {prev_end}: layers {lost}{fix}")
        if b > size:
            raise PlanError(
                f"{r} ends at layer {b}, expected at most {size}: the model has {size} layers{fix}"
            )
        prev_end = b
    if prev_end != size:
        what = f"the last range ends at layer {prev_end}" if ranges else "no ranges were given"
        raise PlanError(f"{what}, expected {size}: layers [{prev_end}, {size}) are in no stage{fix}")


def plan_budgets(costs: ModelCosts, budgets: Sequence[int], context_tokens: int = 4096,
                 balance: str = "memory", read_context: int | None = None) -> PartitionPlan:
    """Fit stage i within budgets[i]; PlanError if nothing fits. ``balance="memory"``: minimise the largest
    memory/budget ratio; ``"reads"``: among the splits that fit, minimise the largest stage's bytes read per
    decode step (``plan_balanced``, KV at ``read_context``).

    Ties go to the smallest sum of squares, then the smallest cut positions. When nothing fits, the
    error reports the split with the smallest largest overflow in bytes.
    """
    _check_request(costs, len(budgets), context_tokens)
    _check_balance(balance)
    if any(b <= 0 for b in budgets):
        raise PlanError(f"expected positive budgets, found {list(budgets)}; give each stage some memory")
    chain, n = _chain(costs), len(budgets)

    def memory(i: int, a: int, b: int) -> int:
        return chain.stage(i, n, a, b, context_tokens, None).memory_bytes

    def ratio_sq(i: int, a: int, b: int) -> Fraction:
        return Fraction(memory(i, a, b), budgets[i]) ** 2

    worst, ranges = optimal_ranges(
        costs.num_layers, n, lambda i, a, b: Fraction(memory(i, a, b), budgets[i]), ratio_sq
    )
    if worst <= 1 and balance == "reads":
        kv = chain.kv_reads(context_tokens if read_context is None else read_context)

        def reads(i: int, a: int, b: int) -> int | None:
            return chain.reads(i, n, a, b, kv) if memory(i, a, b) <= budgets[i] else None

        _, ranges = optimal_ranges(costs.num_layers, n, reads, lambda i, a, b: (reads(i, a, b) or 0) ** 2)
        return _make_plan(chain, "budgets-reads", ranges, context_tokens, budgets)
    if worst <= 1:
        return _make_plan(chain, "budgets", ranges, context_tokens, budgets)
    _, ranges = optimal_ranges(costs.num_layers, n, lambda i, a, b: memory(i, a, b) - budgets[i], ratio_sq)
    raise PlanError(_overflow_message(_make_plan(chain, "budgets", ranges, context_tokens, budgets)))


def _overflow_message(best: PartitionPlan) -> str:
    over = [s for s in best.stages if s.budget_bytes is not None and s.memory_bytes > s.budget_bytes]
    parts = [
        f"stage {s.index} by {format_bytes(s.memory_bytes - (s.budget_bytes or 0))} "
        f"(needs {format_bytes(s.memory_bytes)})"
        for s in over
    ]
    return (
        f"no split of {best.stages[-1].stage.end} layers fits budgets "
        f"{', '.join('-' if s.budget_bytes is None else format_bytes(s.budget_bytes) for s in best.stages)} at {best.context_tokens} tokens of context: "
        f"best plan {' '.join(format_range(s.layers) for s in best.stages)} still overflows {', '.join(parts)}; "
        f"raise {'that budget' if len(over) == 1 else 'those budgets'}, add a node, shorten the context, "
        f"or choose a smaller weight format"
    )


def parse_layers(text: str) -> list[tuple[int, int]]:
    """Parse ``"0:3,3:5,5:7"`` into half-open ranges; only the syntax is checked here."""
    out = []
    for item in text.split(","):
        m = _RANGE_RE.fullmatch(item.strip())
        if m is None:
            raise PlanError(
                f"expected comma-separated start:end layer ranges such as 0:3,3:5,5:7; "
                f"found {item.strip()!r} in {text!r}; write each range as two integers around a colon"
            )
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def parse_budgets(text: str) -> list[int]:
    """Parse ``"2GB,512MiB,1.5GiB,1000000"`` into bytes (GB = 1e9, GiB = 2**30, bare numbers are bytes)."""
    out = []
    for item in text.split(","):
        m = _BYTES_RE.fullmatch(item.strip().lower())
        if m is None or m.group(2) not in _UNITS:
            raise PlanError(
                f"expected comma-separated sizes such as 2GB,512MiB,1.5GiB,1000000 (units B, KB, KiB, MB, "
                f"MiB, GB, GiB, TB, TiB); found {item.strip()!r} in {text!r}; fix that size"
            )
        size = int(Fraction(m.group(1)) * _UNITS[m.group(2)])
        if size <= 0:
            raise PlanError(
                f"expected a positive size, found {item.strip()!r} in {text!r}; give each stage memory"
            )
        out.append(size)
    return out
