"""One stream's KV cache at one stage: the stateful request plus the mask over its physical positions.

The cache is append-only in physical positions. Each cached position has a mask entry (1 = visible to
attention, 0 = hidden), and a position's rotary angle was applied when it was cached, so physical
order never matters to the maths: attention sees exactly the visible positions.

Two ways to take back the last ``k`` visible positions (speculative decoding rejects drafts):

* **rewind** (mask): set their mask entries to 0. Costs a list update; the cache keeps the holes.
* **trim** (physical): read every state, keep the other positions, write the states back. The copy
  must be contiguous: OpenVINO silently mis-reads a strided view as a u8 KV cache (docs/speculation.md).

**Compaction** removes the holes the same physical way, keeping only visible positions; a
:class:`CompactionPolicy` decides when (holes pass a share of the cache, or the cache nears its
limit). Masked and compacted caches give the same logits: holes contribute exp(-inf) = 0.

:class:`CacheMask` is the bookkeeping alone; the head keeps one per stream as a mirror of what every
stage holds, so it can decide compaction once for the whole chain. :class:`KVCache` adds the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from ovshard.bundle import names
from ovshard.errors import BundleError

KV_SEQ_AXIS = 2  # every state is [batch, kv_heads, positions, head_dim] (MakeStatefulKVPass)


@dataclass(frozen=True)
class CompactionPolicy:
    """When to compact: holes reach ``hole_share`` of the cache (and at least ``min_holes``), or the
    next step would take the physical cache past ``limit`` positions (None: no limit)."""

    hole_share: float = 0.5
    min_holes: int = 64
    limit: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.hole_share <= 1:
            raise ValueError(f"hole_share must be in (0, 1], got {self.hole_share!r}")
        if self.min_holes < 1:
            raise ValueError(f"min_holes must be >= 1, got {self.min_holes!r}")

    def wants(self, cache: CacheMask, incoming: int) -> bool:
        holes = cache.holes
        if holes == 0:
            return False
        if self.limit is not None and cache.physical + incoming > self.limit:
            return True
        return holes >= self.min_holes and holes >= self.hole_share * cache.physical


@dataclass
class CacheMask:
    """The mask over a cache's physical positions, with counters of what was done to it."""

    mask: list[int] = field(default_factory=list)
    rewinds: int = 0  # rewind calls that hid something
    hidden: int = 0  # positions hidden by rewinds
    compactions: int = 0

    @property
    def physical(self) -> int:
        return len(self.mask)

    @property
    def visible(self) -> int:
        """The logical length: the next token's position id."""
        return sum(self.mask)

    @property
    def holes(self) -> int:
        return self.physical - self.visible

    def append(self, entries: list[int] | tuple[int, ...]) -> None:
        self.mask.extend(entries)

    def last_visible(self, count: int) -> list[int]:
        """Physical indices of the newest ``count`` visible positions."""
        if not 0 <= count <= self.visible:
            raise ValueError(f"cannot take back {count} positions: the cache holds {self.visible} visible")
        found: list[int] = []
        i = len(self.mask) - 1
        while len(found) < count:
            if self.mask[i]:
                found.append(i)
            i -= 1
        return found

    def rewind(self, count: int) -> None:
        """Hide the newest ``count`` visible positions; the cache itself is untouched."""
        if count == 0:  # every step asks; spare it the O(cache) count of visible positions
            return
        for i in self.last_visible(count):
            self.mask[i] = 0
        self.rewinds += 1
        self.hidden += count

    def compact(self) -> None:
        """Drop every hidden position (the mask becomes all ones)."""
        if self.holes:
            self._keep([i for i, m in enumerate(self.mask) if m])
            self.compactions += 1

    def reset(self) -> None:
        self.mask = []

    def _keep(self, indices: list[int]) -> None:
        self.mask = [self.mask[i] for i in indices]


class KVCache(CacheMask):
    """A stream's stateful InferRequest and the mask over its KV cache."""

    def __init__(self, request: ov.InferRequest) -> None:
        super().__init__()
        self.request = request

    def reset(self) -> None:
        self.request.reset_state()
        super().reset()

    def trim(self, count: int) -> None:
        """Physically remove the newest ``count`` visible positions (the costly alternative to rewind)."""
        drop = set(self.last_visible(count))
        if drop:
            self._keep([i for i in range(self.physical) if i not in drop])

    def _keep(self, indices: list[int]) -> None:
        """Keep these physical positions, in order, in every state (a contiguous copy) and the mask."""
        if len(indices) == self.physical:
            return
        take = np.asarray(indices, dtype=np.int64)
        for state in self.request.query_state():
            kept = np.take(state.state.data, take, axis=KV_SEQ_AXIS)  # np.take copies: contiguous
            state.state = ov.Tensor(np.ascontiguousarray(kept))
        super()._keep(indices)

    def step(self, inputs: StepInputs, output: ov.Output, rewind: int = 0, compact: bool = False) -> np.ndarray:
        """Apply a rewind and a compaction if asked, then run the new tokens; returns output ``output``."""
        self.rewind(rewind)
        if compact:
            self.compact()
        out = self.request.infer(inputs.build(self.mask))[output]
        self.append(inputs.mask_delta)
        return out


@dataclass(frozen=True)
class StepInputs:
    """One step's new tokens: ``x`` is ids [1, T] or activations [1, T, H] under input ``primary``."""

    primary: str
    x: np.ndarray
    position: int  # position id of the first new token
    mask_delta: tuple[int, ...]
    max_positions: int
    logit_rows: int | None = None  # a last stage loaded with logit_rows.slice_logit_rows: the rows to compute

    def build(self, cached: list[int]) -> dict:
        """The request's inputs, given the mask over what is already cached."""
        inputs = step_inputs(self.primary, self.x, cached + list(self.mask_delta), self.position, self.max_positions)
        if self.logit_rows is not None:
            inputs[names.LOGIT_ROWS] = np.array([self.logit_rows], dtype=np.int64)
        return inputs


def step_inputs(primary: str, x: np.ndarray, mask: list[int], position: int, max_positions: int) -> dict:
    """One step's inputs: x is ids [1, T] or activations [1, T, H]; mask covers cache + the T new tokens."""
    seq = x.shape[1]
    if position + seq > max_positions:
        raise BundleError(f"position {position + seq - 1} is beyond this bundle's rotary table "
                          f"({max_positions} positions); recompile with a larger --max-positions")
    return {
        primary: x,
        names.ATTENTION_MASK: np.array([mask], dtype=np.int64),  # [1, cache + T]
        names.POSITION_IDS: np.arange(position, position + seq, dtype=np.int64)[None, :],  # [1, T]
        names.BEAM_IDX: np.zeros(1, dtype=np.int32),
    }
