"""What the engine (engine.py) runs over: a Link (a chain of stages: workers over TCP, stateful streams, or the
stages in this process), the Host that owns it, and what a link hands back.

A link answers each tick it was sent with the wanted rows' scores (a p.Result tagged with the tick over TCP, or a
:class:`Scored` in this process, its Scores as they are) and the tick's p.BatchDone, and reports its own failure as
a StageFailure, all through the ``deliver`` it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.wire import protocol as p


@dataclass(frozen=True)
class Scored:
    """A last stage's answer to one row of a tick handed over in this process, as the accept rule reads it (what
    a p.Result carries as a Tensor over TCP); ``seq`` the row's sequence."""

    tick: int
    seq: int
    scores: Scores


Deliver = Callable[[p.Message | Scored | StageFailure], None]


class Link(Protocol):
    """A chain of stages as the engine sees it: its depth, the KV blocks its planner schedules in (None: a chain
    no engine runs on), where a tick goes, who hears the answers to ticks and the chain's failure, and the
    sequences the engine is done with (paged stages free their blocks by the block tables alone; stateful ones
    close the sequence's stream: client/streams.py)."""

    depth: int
    blocks: BlockManager | None

    def send_tick(self, batch: p.Batch) -> None: ...  # raises StageFailure

    def listen(self, deliver: Deliver) -> None: ...

    def retire(self, seq: int) -> None: ...

    def close(self) -> None: ...


class Host(Protocol):
    """Who owns the chains (the Head): a new chain in place of a broken one, and the retry window."""

    def reconnect(self, stale: Link, deadline: float, cause: OvshardError) -> Link: ...

    def expired(self, deadline: float) -> bool: ...

    def count_replay(self, tokens: int) -> None: ...
