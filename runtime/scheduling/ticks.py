"""A planned tick as the wire carries it, and the planner settings the head runs with.

The engine (engine.py) plans each tick with the tick planner (tick_planner.py) and hands :func:`tick_message`'s
Batch to stage 0; every stage runs it in one inference and the last one answers each row that wants scores.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from ovshard.runtime.scheduling.plan_types import TickBudget, TickPlan
from ovshard.runtime.wire import protocol as p

MAX_DRAFTS = 16  # drafts one row may verify: the budget leaves a whole tail for every sequence


def tick_budget(max_seqs: int, token_budget: int | None = None, max_chunk: int | None = None) -> TickBudget:
    """The head's planner settings: a budget that always holds every sequence's whole tail (so drafts are
    never cut: a request gets the rows it asked for)."""
    budget = max(token_budget or 0, max_seqs * (1 + MAX_DRAFTS))
    return TickBudget(token_budget=budget, max_seqs=max_seqs, max_chunk=max_chunk)


def tick_message(plan: TickPlan, wants: Mapping[Hashable, str], block_size: int) -> p.Batch:
    """The Batch of ``plan`` (its ``tick`` the Batch's number): each sequence's rows, block table and
    ``wants[seq]`` for the rows that want scores (a row's ``stream`` is its sequence id)."""
    rows: list[p.BatchRow] = []
    tables: list[int] = []
    ids: list[int] = []
    for planned in plan.parts:
        table = planned.blocks[:-(-planned.end // block_size)]
        want = wants[planned.seq] if planned.want else ""
        rows.append(p.BatchRow(int(planned.seq), planned.position, planned.count, want, len(table)))  # type: ignore[call-overload]
        tables.extend(table)
        ids.extend(planned.ids)
    copies = None if not plan.copies else p.Tensor.from_array(np.array(plan.copies, dtype=np.int32))
    return p.Batch(plan.tick, rows, p.Tensor.from_array(np.array(ids, dtype=np.int64)),
                   p.Tensor.from_array(np.array(tables, dtype=np.int32)), copies)
