"""What the tick planner (tick_planner.py) takes and gives: its limits, the rows of a tick, what the head sampled.

Frozen values only, no bookkeeping: :class:`TickBudget` (the budgets), :class:`PlannedRows` and
:class:`TickPlan` (one inference), :class:`Sampled` (the head's answer for one sequence), :class:`SeqView`
and :class:`PlannerStats` (what callers and /metrics read). The counters and the three steps of a tick are
described in :mod:`ovshard.runtime.scheduling.tick_planner`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from ovshard.errors import ConfigError, OvshardError
from ovshard.runtime.scheduling.block_tables import BlockStats

Work = Literal["prefill", "decode", "verify", "none"]


class BatchError(OvshardError):
    """A scheduler call outside its contract (an unknown or repeated sequence, a plan finished out of order,
    results that do not match the plan): a bug in the caller, reported before anything changes."""


@dataclass(frozen=True)
class TickBudget:
    """``token_budget``: most rows in one inference; ``max_seqs``: most sequences holding KV blocks at once
    (<= token_budget, so every running sequence's next row fits a tick); ``max_chunk``: most rows of one
    prefill in one tick (None: the budget); ``defer_shared_prefills``: see tick_planner.py's docstring."""

    token_budget: int = 256
    max_seqs: int = 16
    max_chunk: int | None = None
    defer_shared_prefills: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_seqs <= self.token_budget:
            raise ConfigError(f"a batch needs 1 <= max_seqs <= token_budget (a row for each running sequence), got "
                              f"max_seqs {self.max_seqs}, token_budget {self.token_budget}: raise the budget")
        if self.max_chunk is not None and self.max_chunk < 1:
            raise ConfigError(f"max_chunk must be >= 1 rows (or None: the budget), got {self.max_chunk}")


@dataclass(frozen=True)
class PlannedRows:
    """One sequence's rows in a tick: ``ids`` at positions [position, end) (position = ``past_lens``), its
    block table (covering [0, end) at least), ``want`` logits rows at the end: 0 (a prefill chunk before the
    last), 1 (decode, a prompt's last chunk), K + 1 (K drafts to verify); ``admission``: new at each resume."""

    seq: Hashable
    position: int
    ids: tuple[int, ...]
    blocks: tuple[int, ...]
    want: int
    admission: int

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def end(self) -> int:
        return self.position + self.count

    @property
    def drafts(self) -> int:
        return max(self.want - 1, 0)


@dataclass(frozen=True)
class TickPlan:
    """One inference: ``parts``, one a sequence (their rows concatenated in order); ``copies`` (src, dst) blocks to copy in every cache
    before it; ``preempted`` sequences (KV dropped, recomputed later); ``dropped`` ones, longer than the pool:
    finish them. A plan without rows is not in flight: send nothing, read its preempted and dropped lists."""

    tick: int
    parts: tuple[PlannedRows, ...]
    copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[Hashable, ...] = ()
    dropped: tuple[Hashable, ...] = ()

    @property
    def rows(self) -> int:
        return sum(part.count for part in self.parts)


@dataclass(frozen=True)
class Sampled:
    """What the head made of one sequence's logits rows: ``accepted`` of their K drafts kept (0..K, a prefix),
    ``token`` sampled after the last kept row, ``drafts`` new ones after it for the next tick to verify,
    ``finished``: stop (blocks freed; committed ones stay in the prefix cache)."""

    token: int
    accepted: int = 0
    drafts: tuple[int, ...] = ()
    finished: bool = False


@dataclass(frozen=True)
class SeqView:
    """A sequence as the scheduler knows it (tick_planner.py's docstring defines the counters)."""

    seq: Hashable
    ids: tuple[int, ...]
    arrival: int
    computed: int
    scheduled: int
    drafts: int
    work: Work
    admitted: bool
    awaiting: bool
    preempted: bool
    cached: int = 0  # positions the latest admission found in the prefix cache


@dataclass(frozen=True)
class PlannerStats:
    """What /metrics reads: ticks planned with rows, rows and sequences over them and in the last one,
    preemptions, dropped sequences, sequences running (holding blocks) and waiting, and the block pool."""

    ticks: int
    rows: int
    seqs: int
    last_rows: int
    last_seqs: int
    preemptions: int
    dropped: int
    running: int
    waiting: int
    blocks: BlockStats

    @property
    def rows_per_tick(self) -> float:
        return self.rows / self.ticks if self.ticks else 0.0

    @property
    def seqs_per_tick(self) -> float:
        return self.seqs / self.ticks if self.ticks else 0.0

