"""Place a bundle's stages on measured nodes: contiguous runs of the bundle's stages, one run a node.

The units are the bundle's own stages (each a layer range, compiled already); a placed stage is a run of
consecutive units on one node, so the cuts allowed are the units' boundaries. The numbers come from the
nodes' probes (``ovshard.runtime.cluster.probe``: seconds per weight byte of a decode step, free memory) and the
bundle's plan (the weight and KV bytes recorded per unit).

Time model: a decode step of one token reads each weight of the stage once, so a stage's step takes its
weight bytes x the node's seconds per byte. The embedding table counts for memory but not for time (a
gather reads one row a token); the head (final norm + lm_head) counts for both. Memory is the weights plus
KV bytes per token x ``context_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ovshard.bundle.manifest import Manifest
from ovshard.bundle.plan import format_bytes, format_range
from ovshard.errors import PlanError
from ovshard.frontend.arch import ARCHITECTURES
from ovshard.plan.costs import model_costs
from ovshard.plan.partition import optimal_ranges

STRATEGIES = ("measured", "even")
# A node's usable memory is 90% of what its probe found free: the runtime's own buffers (activations, the
# plugin's scratch and compiled kernels, Python, the Ray worker) and the OS need memory the plan counts not.
HEADROOM = 0.9
TOLERANCE = 1.05  # plans whose slowest stage is within 5% of the best count as equally fast
MAX_PERMUTED_NODES = 6  # up to this many nodes every order is tried; beyond, nearest neighbour from the head
_COLUMNS = ("stage", "node", "host", "layers", "predicted ms", "memory @ {ctx}")


@dataclass(frozen=True)
class NodeProbe:
    """What a node's probe measured (``ovshard.runtime.cluster.probe.probe_layer``), in plain data."""

    node: str  # the node's id (a Ray node id)
    host: str
    seconds_per_byte: float  # decode-step seconds per weight byte as stored
    free_bytes: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds_per_byte) and self.seconds_per_byte > 0) or self.free_bytes < 0:
            raise PlanError(f"node {self.node} (host {self.host}): expected seconds_per_byte > 0 and free_bytes "
                            f">= 0, found {self.seconds_per_byte} and {self.free_bytes}; probe the node again")

    @property
    def usable_bytes(self) -> int:
        return int(self.free_bytes * HEADROOM)


@dataclass(frozen=True)
class Placement:
    """Placed stage i runs layers ``ranges[i]`` (the bundle's stages ``groups[i]``) on node ``nodes[i]``."""

    strategy: str  # "measured" | "even"
    nodes: tuple[str, ...]
    hosts: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # half-open layer ranges
    groups: tuple[tuple[int, ...], ...]  # the bundle's stage indices, per placed stage
    step_s: tuple[float, ...]  # predicted decode step per placed stage
    memory_bytes: tuple[int, ...]  # weights + KV at context_tokens
    left_out: tuple[tuple[str, str], ...]  # (node, why it holds no stage)
    context_tokens: int
    round_trip_s: float  # head -> stage 0 -> ... -> last -> head, from the measured round trips (0 where none)

    @property
    def slowest_step_s(self) -> float:
        """The pipeline's bottleneck: with several streams in flight one token a step of this long."""
        return max(self.step_s)

    @property
    def token_s(self) -> float:
        """One stream's time per token: every stage's step in turn plus the round trip around the chain."""
        return sum(self.step_s) + self.round_trip_s

    def format_table(self) -> str:
        """A fixed-width table, one row a placed stage."""
        rows = [[c.format(ctx=self.context_tokens) for c in _COLUMNS]]
        for i, (node, host, r, s, m) in enumerate(
                zip(self.nodes, self.hosts, self.ranges, self.step_s, self.memory_bytes, strict=True)):
            rows.append([str(i), node[:12], host, format_range(r), f"{s * 1e3:.2f}", format_bytes(m)])
        widths = [max(len(r[c]) for r in rows) for c in range(len(_COLUMNS))]
        return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows)


@dataclass(frozen=True)
class _Units:
    """The bundle's stages as placement units, with prefix sums so any run of them costs O(1)."""

    bounds: tuple[int, ...]  # [F + 1] the layer each unit starts at, then num_layers
    weight_prefix: tuple[int, ...]  # [F + 1] decoder-layer weight bytes (no embedding, no head)
    kv_prefix: tuple[int, ...]  # [F + 1] KV bytes per token
    embed: int
    head: int
    context_tokens: int

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def time_bytes(self, a: int, b: int) -> int:
        """Bytes a decode step of units [a, b) reads: its layers, and the head when it is last."""
        return self.weight_prefix[b] - self.weight_prefix[a] + (self.head if b == self.count else 0)

    def memory(self, a: int, b: int) -> int:
        weights = self.time_bytes(a, b) + (self.embed if a == 0 else 0)
        return weights + (self.kv_prefix[b] - self.kv_prefix[a]) * self.context_tokens

    def layers(self, a: int, b: int) -> tuple[int, int]:
        return (self.bounds[a], self.bounds[b])


def _units(manifest: Manifest, context_tokens: int) -> _Units:
    """The plan's recorded weight bytes per stage, less the embedding (stage 0) and head (last), which the cost
    model the compile used gives apart; each stage's KV bytes a token as its caches store them under the bundle's
    hints (bundle/kv_store.py), whatever count the compile recorded."""
    dims, plan = manifest.architecture, manifest.plan.stages
    spec = ARCHITECTURES.get(dims.model_type)
    if spec is None:
        raise PlanError(f"the bundle's model_type {dims.model_type!r} has no architecture entry in this ovshard; "
                        "upgrade ovshard to the version that compiled the bundle")
    blocks = model_costs(spec, dims, manifest.weights).blocks
    embed, head = blocks[0].weight_bytes, blocks[-1].weight_bytes
    layers = [s.weight_bytes - (embed if s.stage.first else 0) - (head if s.stage.last else 0) for s in plan]
    if min(layers) < 0:
        raise PlanError(f"the bundle's plan records stage weights {[s.weight_bytes for s in plan]}, less than "
                        f"its embedding ({embed}) and head ({head}) by this ovshard's cost model; recompile it")
    prefix = [0]
    kv = [0]
    per_layer = manifest.kv_store.bytes_per_token(dims)  # as the stages store it now, whatever the compile counted
    for w, s in zip(layers, plan, strict=True):
        prefix.append(prefix[-1] + w)
        kv.append(kv[-1] + len(s.stage.layers) * per_layer)
    bounds = (*(s.stage.start for s in plan), plan[-1].stage.end)
    return _Units(bounds, tuple(prefix), tuple(kv), embed, head, context_tokens)


class _State(NamedTuple):
    mask: int  # nodes used (any order); 0 in a fixed order, where `last` says which nodes may follow
    last: int  # the node of the stage before, -1 before the first
    placed: int  # stages so far; 0 unless a count is asked for
    has: bool  # whether the required node is used; False unless one is required


_Rank = tuple[float, int, float]  # (round trip s, nodes, slowest step s): the order plans within 5% are ranked by
_Value = Callable[[int, int, int, int], Any]  # (previous node, node, a, b) -> score non-decreasing in b, or None


class _Search:
    """Node sequences x contiguous unit ranges by dynamic programming over (next unit, _State).

    ``order`` None: any sequence of distinct nodes; else subsequences of that order. ``stages``: exactly
    that many stages; ``required``: sequences using that node only.
    """

    def __init__(self, units: _Units, nodes: int, stages: int | None, order: Sequence[int] | None,
                 required: int | None = None) -> None:
        self.units, self.nodes, self.stages, self.required = units, nodes, stages, required
        self.order = None if order is None else tuple(order)

    def _next(self, s: _State) -> Iterator[tuple[int, _State]]:
        if self.order is None:
            candidates: Sequence[int] = [n for n in range(self.nodes) if not s.mask >> n & 1]
        else:
            candidates = self.order[self.order.index(s.last) + 1:] if s.last >= 0 else self.order
        for n in candidates:
            yield n, _State(s.mask | 1 << n if self.order is None else 0, n,
                            s.placed + 1 if self.stages else 0, s.has or n == self.required)

    def _ends(self, a: int, s: _State) -> range:
        """Ends b of a stage starting at unit a after which state s holds; later stages need a unit each."""
        last = self.units.count
        if self.stages and s.placed == self.stages:
            return range(last, last + 1)
        return range(a + 1, last - (self.stages - s.placed if self.stages else 0) + 1)

    def _done(self, s: _State) -> bool:
        return (not self.stages or s.placed == self.stages) and (self.required is None or s.has)

    def solve(self, value: _Value, combine: Callable[[Any, Any], Any]) -> tuple[Any, list[tuple[int, int, int]]]:
        """The least ``combine`` of stage values and its stages [(node, a, b)]; (None, []) when none is allowed.

        A stage's value never exceeds the combined value of it and the rest, so ends past a value that is
        already no better than the best found are skipped.
        """
        memo: dict[tuple[int, _State], tuple[Any, int, int, _State] | None] = {}
        size = self.units.count

        def best(a: int, s: _State) -> Any:
            if (a, s) not in memo:
                found: tuple[Any, int, int, _State] | None = None
                for n, nxt in self._next(s):
                    for b in self._ends(a, nxt):
                        v = value(s.last, n, a, b)
                        if v is None or (found is not None and v >= found[0]):
                            break
                        total = (v if self._done(nxt) else None) if b == size else _combine(v, best(b, nxt), combine)
                        if total is not None and (found is None or total < found[0]):
                            found = (total, n, b, nxt)
                memo[(a, s)] = found
            entry = memo[(a, s)]
            return None if entry is None else entry[0]

        start = _State(0, -1, 0, False)
        total = best(0, start)
        stages, a, s = [], 0, start
        while total is not None and a < size:
            entry = memo[(a, s)]
            assert entry is not None
            _, n, b, s = entry
            stages.append((n, a, b))
            a = b
        return total, stages


def _combine(v: Any, rest: Any, combine: Callable[[Any, Any], Any]) -> Any:
    return None if rest is None else combine(v, rest)


def _rtt_lookup(rtt_s: Mapping[tuple[str, str], float] | None) -> Callable[[str, str], float]:
    table = dict(rtt_s or {})

    def rtt(u: str, v: str) -> float:
        return 0.0 if u == v else table.get((u, v), table.get((v, u), 0.0))

    return rtt


def _nearest_neighbour(probes: Sequence[NodeProbe], head: str, rtt: Callable[[str, str], float]) -> list[int]:
    """Node indices from ``head`` on, each the nearest (by round trip) of those left; ties in the given order."""
    left = sorted(range(len(probes)), key=lambda n: probes[n].node != head)
    order, here = [], head
    while left:
        n = min(left, key=lambda k: rtt(here, probes[k].node))
        order.append(n)
        left.remove(n)
        here = probes[n].node
    return order


@dataclass(frozen=True)
class _Problem:
    units: _Units
    probes: tuple[NodeProbe, ...]
    head: str
    rtt: Callable[[str, str], float]
    stages: int | None

    def step_s(self, n: int, a: int, b: int) -> float | None:
        """Node n's predicted decode step for units [a, b), or None when they do not fit its memory."""
        probe = self.probes[n]
        if self.units.memory(a, b) > probe.usable_bytes:
            return None
        return self.units.time_bytes(a, b) * probe.seconds_per_byte

    def hop_s(self, prev: int, n: int, b: int) -> float:
        """Round trips a stage on node n adds: from the stage before (or the head), and back to the head if last."""
        here = self.probes[n].node
        back = self.rtt(here, self.head) if b == self.units.count else 0.0
        return self.rtt(self.probes[prev].node if prev >= 0 else self.head, here) + back

    def search(self, required: int | None = None) -> _Search:
        order = None if len(self.probes) <= MAX_PERMUTED_NODES else _nearest_neighbour(self.probes, self.head, self.rtt)
        return _Search(self.units, len(self.probes), self.stages, order, required)

    def ranked(self, bound: float, required: int | None = None) -> tuple[_Rank | None, list[tuple[int, int, int]]]:
        """The first plan by (round trip, nodes, slowest step) among those whose stages all take <= ``bound``."""

        def value(prev: int, n: int, a: int, b: int) -> _Rank | None:
            step = self.step_s(n, a, b)
            return None if step is None or step > bound else (self.hop_s(prev, n, b), 1, step)

        return self.search(required).solve(value, lambda x, y: (x[0] + y[0], x[1] + y[1], max(x[2], y[2])))

    def fastest(self, required: int | None = None) -> float | None:
        """The least slowest-stage step over the plans allowed (using node ``required``), or None if none fits."""
        return self.search(required).solve(lambda prev, n, a, b: self.step_s(n, a, b), max)[0]

    def placement(self, strategy: str, stages: Sequence[tuple[int, int, int]], left_out: Sequence[tuple[str, str]]
                  ) -> Placement:
        u, ps = self.units, self.probes
        chosen = [ps[n] for n, _, _ in stages]
        steps = tuple(u.time_bytes(a, b) * ps[n].seconds_per_byte for n, a, b in stages)
        trip = sum(self.hop_s(stages[i - 1][0] if i else -1, n, b) for i, (n, _, b) in enumerate(stages))
        return Placement(strategy, tuple(p.node for p in chosen), tuple(p.host for p in chosen),
                         tuple(u.layers(a, b) for _, a, b in stages), tuple(tuple(range(a, b)) for _, a, b in stages),
                         steps, tuple(u.memory(a, b) for _, a, b in stages), tuple(left_out), u.context_tokens, trip)


def plan_placement(manifest: Manifest, probes: Sequence[NodeProbe], head: str,
                   rtt_s: Mapping[tuple[str, str], float] | None = None, stages: int | None = None,
                   context_tokens: int = 4096, strategy: str = "measured") -> Placement:
    """Place the bundle's stages on ``probes``' nodes as contiguous runs, one run a node.

    "measured": minimise the slowest placed stage's predicted step over which nodes take part (any of them,
    or exactly ``stages``), their order and the runs; among plans within 5% of that, the smallest round trip
    head -> stage 0 -> ... -> last -> head (``rtt_s``: seconds per node pair, either way round; missing
    pairs 0), then the fewest nodes, then the fastest. "even": ``stages`` (default: one a node) runs of
    layer counts as equal as the bundle's stages allow, on the nodes in the given order (``head``'s first).
    """
    problem = _check(manifest, probes, head, rtt_s, stages, context_tokens, strategy)
    if strategy == "even":
        return _even(problem)
    return _measured(problem)


def _check(manifest: Manifest, probes: Sequence[NodeProbe], head: str, rtt_s: Mapping[tuple[str, str], float] | None,
           stages: int | None, context_tokens: int, strategy: str) -> _Problem:
    """The request as a _Problem; PlanError naming what is wrong with it."""
    if strategy not in STRATEGIES:
        raise PlanError(f"placement strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    names = [p.node for p in probes]
    if not probes or len(set(names)) != len(names):
        raise PlanError(f"expected one probe per node, at least one; found nodes {names}: probe each node once")
    if context_tokens < 0:
        raise PlanError(f"expected context_tokens >= 0, found {context_tokens}; pass the context to size KV for")
    units = _units(manifest, context_tokens)
    if stages is not None and stages < 1:
        raise PlanError(f"asked for {stages} stages; expected at least 1, or none to let the planner choose")
    if stages is not None and stages > len(probes):
        raise PlanError(f"asked for {stages} stages on {len(probes)} nodes, but a placed stage takes a node of its "
                        f"own: ask for at most {len(probes)}, add nodes, or use `--placement bundle`, which runs "
                        "several stages on one node")
    if stages is not None and stages > units.count:
        raise PlanError(f"asked for {stages} stages, but the bundle has {units.count} stages and a placed stage "
                        f"is a run of them: ask for at most {units.count}, or recompile with `ovshard compile "
                        f"--stages {stages}` (or more)")
    return _Problem(units, tuple(probes), head, _rtt_lookup(rtt_s), stages)


def _measured(problem: _Problem) -> Placement:
    best = problem.fastest()
    if best is None:
        raise PlanError(_shortfall(problem))
    bound = best * TOLERANCE
    key, chosen = problem.ranked(bound)
    assert key is not None  # the fastest plan itself is within the bound
    used = {n for n, _, _ in chosen}
    left = [(p.node, _left_out_message(problem, n, bound, key)) for n, p in enumerate(problem.probes) if n not in used]
    return problem.placement("measured", chosen, left)


def _left_out_message(problem: _Problem, n: int, bound: float, chosen: _Rank) -> str:
    """Why node n holds no stage, from the best plans that use it: too slow, no room, or ranked lower."""
    p = problem.probes[n]
    speed = f"its probe: {p.seconds_per_byte * 1e12:.1f} ms per GB"  # s/byte * 1e9 bytes * 1e3 ms
    where = f"node {p.node[:12]} (host {p.host}) left out"
    with_it = problem.fastest(required=n)
    if with_it is None:
        return (f"{where}: no placement that uses it fits in the nodes' memory ({format_bytes(p.usable_bytes)} "
                f"usable on it; {speed})")
    times = f"with it the slowest stage would take {with_it * 1e3:.2f} ms, without it {chosen[2] * 1e3:.2f} ms"
    rank = problem.ranked(bound, required=n)[0] if with_it <= bound else None
    if rank is None:
        why = ""
    elif rank[0] > chosen[0]:
        why = (f"; of the plans within {TOLERANCE - 1:.0%} of the fastest, one without it has the smaller round "
               f"trip ({chosen[0] * 1e3:.2f} ms, with it at best {rank[0] * 1e3:.2f} ms)")
    elif rank[1] > chosen[1]:
        why = (f"; of the plans within {TOLERANCE - 1:.0%} of the fastest, one without it uses fewer nodes "
               f"({chosen[1]}, with it at least {rank[1]})")
    elif rank[2] > chosen[2]:
        why = ""
    else:
        why = "; plans with it tie with the one chosen, which uses nodes given earlier"
    return f"{where}: {times} ({speed}){why}"


def _shortfall(problem: _Problem) -> str:
    """Why nothing fits: the split whose worst overflow of a node's usable memory is least, and by how much."""
    u, ps = problem.units, problem.probes
    over, stages = problem.search().solve(lambda prev, n, a, b: u.memory(a, b) - ps[n].usable_bytes, max)
    n, a, b = max(stages, key=lambda s: u.memory(s[1], s[2]) - ps[s[0]].usable_bytes)
    total = u.memory(0, u.count)
    return (f"no placement of the bundle's {u.count} stages ({u.bounds[-1]} layers, {format_bytes(total)} at "
            f"{u.context_tokens} tokens of context) fits the memory of nodes {', '.join(p.node for p in ps)} "
            f"({HEADROOM:.0%} of each node's free memory is usable): the best still overflows node {ps[n].node} "
            f"(host {ps[n].host}) by {format_bytes(over)}, layers {format_range(u.layers(a, b))} needing "
            f"{format_bytes(u.memory(a, b))} of its {format_bytes(ps[n].usable_bytes)}; serve fewer context "
            "tokens, recompile with a smaller weight format (e.g. --weights int4_sym), or add a node")


def _even(problem: _Problem) -> Placement:
    """Layer counts as equal as the units allow on the first nodes, head's first; speeds only predict the steps."""
    u, ps = problem.units, problem.probes
    order = sorted(range(len(ps)), key=lambda n: ps[n].node != problem.head)
    count = problem.stages or min(len(ps), u.count)

    def layers(i: int, a: int, b: int) -> int:
        return u.bounds[b] - u.bounds[a]

    _, ranges = optimal_ranges(u.count, count, layers, lambda i, a, b: layers(i, a, b) ** 2)
    stages = [(order[i], a, b) for i, (a, b) in enumerate(ranges)]
    for n, a, b in stages:
        if problem.step_s(n, a, b) is None:
            raise PlanError(f"the even split puts layers {format_range(u.layers(a, b))} ({format_bytes(u.memory(a, b))} "
                            f"at {u.context_tokens} tokens of context) on node {ps[n].node} (host {ps[n].host}), "
                            f"which has {format_bytes(ps[n].usable_bytes)} usable ({HEADROOM:.0%} of its free "
                            "memory); use the measured placement, serve fewer context tokens, or recompile with "
                            "a smaller weight format")
    left = [(ps[n].node, f"node {ps[n].node[:12]} (host {ps[n].host}) left out: the even split uses the first {count} "
             f"nodes, the head's first") for n in order[count:]]
    return problem.placement("even", stages, left)
