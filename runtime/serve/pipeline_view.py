"""The live view of a pipeline that the web page at ``/`` shows (``GET /v1/pipeline``).

Each decode step of every request in flight is recorded as it happens (the prefill step is left out:
it is one long step per request and would drown the per-step figures). A snapshot gives, per stage,
its address, layers and mean compute ms over the last ``steps`` decode steps, the per-hop network ms
(step round trip minus the stages' compute, over stages + 1 hops, as ``Stats.to_dict`` counts it), the
tokens per second of all streams together over the last ``window_s`` seconds, and the speculative
acceptance of every request so far. Over paged stages each stage also shows its batch occupancy: the
sequences and rows of the latest tick, the mean rows a tick, and its KV blocks (the head's block tables are
every stage's: the same figures at each).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ovshard.bundle.manifest import Manifest
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.scheduling.tick_planner import PlannerStats


@dataclass(frozen=True)
class _Step:
    at: float  # when it was recorded (time.monotonic)
    round_trip_s: float
    stage_s: dict[str, float]  # "stage0" -> compute seconds
    tokens: int  # tokens the step produced


class PipelineView:
    def __init__(self, manifest: Manifest, addresses: list[str], steps: int = 64, window_s: float = 10.0) -> None:
        self.manifest, self.addresses, self.window_s = manifest, addresses, window_s
        self.recent: deque[_Step] = deque(maxlen=steps)
        self.lock = threading.Lock()
        self.drafted = self.accepted = 0

    def record(self, stats: Stats, seen: int) -> int:
        """Record the decode steps of ``stats`` after the first ``seen`` steps; returns how many are seen now.
        Called from a stream slot's thread after each token."""
        steps = len(stats.step_tokens)  # a step counts once all of its tokens are out
        now = time.monotonic()
        with self.lock:
            for i in range(max(seen, 1), steps):
                self.recent.append(_Step(now, stats.step_s[i], dict(stats.stage_s[i]), stats.step_tokens[i]))
        return steps

    def finished(self, stats: Stats) -> None:
        with self.lock:
            self.drafted += stats.drafted
            self.accepted += stats.accepted

    def snapshot(self, model: str, active: int, waiting: int, batch: PlannerStats | None = None) -> dict:
        now = time.monotonic()
        with self.lock:
            recent = list(self.recent)
            drafted, accepted = self.drafted, self.accepted
        in_window = [s for s in recent if now - s.at <= self.window_s]
        span = (now - min(s.at for s in in_window)) if len(in_window) > 1 else 0.0
        stages = []
        for entry, address in zip(self.manifest.stages, self.addresses, strict=False):
            name = f"stage{entry.stage.index}"
            compute = [s.stage_s[name] for s in recent if name in s.stage_s]
            stages.append({"stage": entry.stage.index, "address": address, "host": address.rsplit(":", 1)[0],
                           "layers": [entry.stage.start, entry.stage.end],
                           "compute_ms": round(1000 * sum(compute) / len(compute), 3) if compute else None,
                           "batch": _occupancy(batch)})
        network = [(s.round_trip_s - sum(s.stage_s.values())) / (len(s.stage_s) + 1) for s in recent if s.stage_s]
        return {
            "model": model,
            "layers": self.manifest.architecture.num_layers,
            "stages": stages,
            "network_ms_per_hop": round(1000 * max(0.0, sum(network) / len(network)), 3) if network else None,
            "tokens_per_s": round(sum(s.tokens for s in in_window) / span, 2) if span > 0 else 0.0,
            "decode_steps": len(recent),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "active_streams": active,
            "waiting": waiting,
        }


def _occupancy(batch: PlannerStats | None) -> dict | None:
    if batch is None:
        return None
    blocks = batch.blocks
    return {"sequences": batch.last_seqs, "rows": batch.last_rows, "rows_per_tick": round(batch.rows_per_tick, 2),
            "kv_blocks_used": blocks.used, "kv_blocks_total": blocks.used + blocks.cached + blocks.free}
