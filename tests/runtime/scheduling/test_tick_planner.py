"""The stage scheduler (runtime/scheduling/tick_planner.py): budgets, chunked prefill, prefix reuse, preemption, rewinds.

Pure bookkeeping, no OpenVINO, no sockets. ``Stage`` stands in for a paged stage: it writes each row's token id
into the (block, slot) its plan names and predicts the next token from the ids it reads back, so a block
table that pointed at the wrong KV shows as a token that differs from the sequence's solo run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ovshard.errors import ConfigError
from ovshard.runtime.engine.paged import blocks_for
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.tick_planner import BatchError, Sampled, TickBudget, TickPlan, TickPlanner

BS = 4  # positions a block in these tests
VOCAB = 5


def model(context: Sequence[int]) -> int:
    """The next token after ``context``: a fixed function of every id before it (a stand-in for the model)."""
    h = 7
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def solo(prompt: Sequence[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        ids.append(model(ids))
    return ids


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class Stage:
    """A paged stage over token ids: copies blocks, writes rows into their slots, reads back the context."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, plan: TickPlan) -> dict[Hashable, list[int]]:
        """Each wanted row's prediction, as the last stage's logits would give it."""
        for src, dst in plan.copies:
            for slot in range(BS):
                if (src, slot) in self.slots:
                    self.slots[dst, slot] = self.slots[src, slot]
        tables = [rows.blocks[:blocks_for(rows.end, BS)] for rows in plan.parts]
        for rows, table in zip(plan.parts, tables, strict=True):
            assert len(table) == blocks_for(rows.end, BS), "the block table does not cover the rows"
            written = set(table[rows.position // BS:])
            for other, other_table in zip(plan.parts, tables, strict=True):
                assert other is rows or not written & set(other_table), "a block written while another reads it"
            for p, token in enumerate(rows.ids, start=rows.position):
                self.slots[table[p // BS], p % BS] = token
        out = {}
        for rows, table in zip(plan.parts, tables, strict=True):
            context = [self.slots[table[p // BS], p % BS] for p in range(rows.end)]
            out[rows.seq] = [model(context[:p + 1]) for p in range(rows.end - rows.want, rows.end)]
        return out


def verify(rows_ids: Sequence[int], drafts: int, predicted: Sequence[int]) -> tuple[int, int]:
    """(drafts accepted, next token): greedy verification of the last ``drafts`` ids against the predictions."""
    proposed = rows_ids[len(rows_ids) - drafts:]
    accepted = 0
    while accepted < drafts and predicted[accepted] == proposed[accepted]:
        accepted += 1
    return accepted, predicted[accepted]


class Head:
    """Drives a scheduler as the head would: ``depth`` plans in flight, greedy sampling, ``new`` tokens a sequence,
    drafts from ``propose(ids)`` (None: no speculation)."""

    def __init__(self, sched: TickPlanner, new: dict[Hashable, int], depth: int = 1,
                 propose: Callable[[list[int]], Sequence[int]] | None = None) -> None:
        self.sched, self.new, self.depth, self.propose = sched, new, depth, propose
        self.stage = Stage()
        self.flight: list[tuple[TickPlan, dict[Hashable, list[int]]]] = []
        self.prompts: dict[Hashable, int] = {}
        self.done: dict[Hashable, list[int]] = {}
        self.plans: list[TickPlan] = []

    def add(self, seq: Hashable, prompt: Sequence[int]) -> None:
        self.sched.add(seq, prompt)
        self.prompts[seq] = len(prompt)

    def plan(self) -> TickPlan:
        plan = self.sched.plan_tick()
        self.sched.blocks.check()
        if plan.parts:
            self.flight.append((plan, self.stage.run(plan)))
            self.plans.append(plan)
        return plan

    def finish(self) -> None:
        plan, predicted = self.flight.pop(0)
        results = {}
        for rows in plan.parts:
            if rows.want and rows.seq in self.sched:
                accepted, token = verify(rows.ids, rows.drafts, predicted[rows.seq])
                known = [*self.sched.view(rows.seq).ids[:rows.end - rows.drafts + accepted], token]
                finished = len(known) - self.prompts[rows.seq] >= self.new[rows.seq]
                drafts = () if finished or self.propose is None else tuple(self.propose(known))
                results[rows.seq] = Sampled(token, accepted, drafts, finished)
        for view in self.sched.finish_tick(plan, results):
            self.done[view.seq] = list(view.ids)
        self.sched.blocks.check()

    def step(self) -> TickPlan:
        plan = self.plan()
        if self.flight and (len(self.flight) >= self.depth or not plan.parts):
            self.finish()
        return plan

    @property
    def pending(self) -> int:
        """Sequences the scheduler still holds (running or waiting)."""
        return self.sched.stats.running + self.sched.stats.waiting

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.pending and not self.flight:
                return
            in_flight = bool(self.flight)
            plan = self.step()
            assert plan.parts or in_flight or plan.preempted or plan.dropped, "nothing runs and nothing is in flight"
        raise AssertionError(f"sequences still unfinished after {limit} ticks")


def scheduler(num_blocks: int = 64, budget: int = 16, max_seqs: int = 4, chunk: int | None = None,
              prefix_cache: bool = True, defer: bool = True) -> TickPlanner:
    return TickPlanner(BlockManager(num_blocks, BS, prefix_cache=prefix_cache),
                          TickBudget(budget, max_seqs, chunk, defer))


def test_config_refuses_more_sequences_than_rows():
    """max_seqs > token_budget would leave a running sequence without its row: refused, saying what to do."""
    with pytest.raises(ConfigError, match="raise the budget"):
        TickBudget(token_budget=4, max_seqs=5)
    with pytest.raises(ConfigError, match="max_chunk"):
        TickBudget(max_chunk=0)


def test_prompt_prefills_in_one_tick_and_wants_its_last_row():
    """A prompt within budget: one tick of all its rows from position 0, logits of the last row only."""
    s = scheduler()
    s.add("a", ids(6))
    plan = s.plan_tick()
    (rows,) = plan.parts
    assert (rows.position, rows.ids, rows.want, len(rows.blocks)) == (0, tuple(ids(6)), 1, 2)
    assert s.view("a").work == "none" and s.view("a").awaiting


def test_long_prompt_is_chunked_and_never_blocks_decode_rows():
    """While a 40-token prompt prefills in chunks, the decoding sequence gets its row first in every tick."""
    s = scheduler(budget=8, max_seqs=2, chunk=6)
    head = Head(s, {"a": 30, "b": 1})
    head.add("a", ids(3))
    head.step()  # a's prompt
    head.add("b", ids(40, 100))
    chunks = []
    while "b" not in head.done:
        plan = head.step()
        assert plan.rows <= 8 and plan.parts[0].seq == "a" and plan.parts[0].count == 1
        chunks += [(rows.position, rows.count, rows.want) for rows in plan.parts if rows.seq == "b"]
    assert [c[1] for c in chunks] == [6] * 6 + [4] and [c[2] for c in chunks] == [0] * 6 + [1]
    assert [c[0] for c in chunks] == list(range(0, 40, 6))  # contiguous chunks, the last one wants its logits


def test_prefills_are_served_first_come_first_served():
    """An older prompt gets its chunks before a newer one gets any row; the newer starts with what is left."""
    s = scheduler(budget=8, max_seqs=3)
    for seq, n, start in (("a", 13, 0), ("b", 13, 50), ("c", 3, 100)):
        s.add(seq, ids(n, start))
    first = [[(rows.seq, rows.count) for rows in s.plan_tick().parts] for _ in range(4)]
    assert first == [[("a", 8)], [("a", 5), ("b", 3)], [("b", 8)], [("b", 2), ("c", 3)]]


def test_shared_prefix_is_prefilled_once():
    """A sequence whose prompt starts with committed blocks of another asks only for its uncached tail."""
    s = scheduler()
    head = Head(s, {"a": 2, "b": 2})
    head.add("a", ids(9))
    head.run()
    head.add("b", ids(8) + [60, 61, 62])
    (rows,) = head.plan().parts
    assert (rows.position, rows.ids) == (8, (60, 61, 62))
    assert s.stats.blocks.hit_tokens == 8


@pytest.mark.parametrize("defer", [True, False])
def test_prompts_arriving_together_share_one_prefill(defer: bool):
    """Two prompts with one 8-token prefix, added together: the second waits for the first's commit, then hits."""
    s = scheduler(defer=defer)
    head = Head(s, {"a": 1, "b": 1})
    head.add("a", ids(8) + [40])
    head.add("b", ids(8) + [50, 51])
    plans = [head.step() for _ in range(3)]
    b_rows = [rows for plan in plans for rows in plan.parts if rows.seq == "b"]
    assert (b_rows[0].position, b_rows[0].count) == ((8, 2) if defer else (0, 7))  # a took 9 of the 16 rows


def test_full_pool_preempts_the_newest_which_resumes_by_full_recompute():
    """When the oldest needs a block, the newest is preempted; it later prefills all its known ids again."""
    s = scheduler(num_blocks=5, budget=8, max_seqs=2, prefix_cache=False)
    head = Head(s, {"a": 8, "b": 8})
    head.add("a", ids(6))
    head.add("b", ids(6, 20))
    while not s.stats.preemptions:
        head.step()
    assert s.view("b").preempted and not s.view("b").admitted and "a" in s and s.view("a").admitted
    known = s.view("b").ids
    head.run()
    first = next(rows.admission for p in head.plans for rows in p.parts if rows.seq == "b")
    resumed = [rows for p in head.plans for rows in p.parts if rows.seq == "b" and rows.admission != first]
    chunks = resumed[:next(i for i, rows in enumerate(resumed) if rows.want) + 1]
    assert [rows.position for rows in chunks] == [0, 8] and sum((rows.ids for rows in chunks), ()) == known
    assert head.done == {"a": solo(ids(6), 8), "b": solo(ids(6, 20), 8)}


def test_new_sequence_waits_for_blocks_without_preempting():
    """A newcomer that finds no blocks waits; running sequences are never preempted to admit it."""
    s = scheduler(num_blocks=4, budget=8, max_seqs=2)
    head = Head(s, {"a": 3, "b": 1})
    head.add("a", ids(12))
    head.step()
    head.add("b", ids(8, 30))
    for _ in range(2):
        plan = head.step()
        assert not plan.preempted and [rows.seq for rows in plan.parts] == ["a"]
    head.run()
    assert head.done["b"] == solo(ids(8, 30), 1) and s.stats.preemptions == 0


def test_newcomer_never_overtakes_a_preempted_sequence():
    """Blocks freed by a preemption go to no newcomer: the preempted sequence, older, resumes first."""
    s = scheduler(num_blocks=4, budget=16, max_seqs=3, prefix_cache=False)
    s.add("a", ids(4))
    s.add("b", ids(8, 20))
    s.finish_tick(s.plan_tick(), {"a": Sampled(1), "b": Sampled(2)})  # each now needs a new block; 1 is free
    s.add("c", [99])
    plan = s.plan_tick()
    assert plan.preempted == ("b",) and [rows.seq for rows in plan.parts] == ["a"]
    assert s.stats.blocks.free == 2 and not s.view("c").admitted
    s.finish_tick(plan, {"a": Sampled(3)})
    assert [rows.seq for rows in s.plan_tick().parts] == ["a"]  # b needs 3 blocks of the 2 free; c waits behind it


def test_rejected_drafts_are_rewound_and_emptied_blocks_freed():
    """K+1 verify rows that cross into a new block, none accepted: the table shrinks back and the block returns."""
    s = scheduler()
    s.add("a", ids(3))
    s.finish_tick(s.plan_tick(), {"a": Sampled(3, drafts=(7, 7, 7))})  # known: 0 1 2 3 | 7 7 7
    plan = s.plan_tick()
    (rows,) = plan.parts
    assert (rows.position, rows.count, rows.want, rows.drafts) == (3, 4, 4, 3)
    assert len(rows.blocks) == 2 and s.stats.blocks.used == 2
    s.finish_tick(plan, {"a": Sampled(9, accepted=0)})
    view = s.view("a")
    assert view.ids == (0, 1, 2, 3, 9) and view.computed == view.scheduled == 4
    assert s.blocks.length("a") == 4 and s.stats.blocks.used == 1
    (rows,) = s.plan_tick().parts
    assert (rows.position, rows.ids, rows.want) == (4, (9,), 1)


def test_accepted_drafts_keep_their_rows():
    """Drafts accepted keep their KV: the next tick starts after them with the bonus token."""
    s = scheduler()
    s.add("a", ids(3))
    s.finish_tick(s.plan_tick(), {"a": Sampled(3, drafts=(4, 5))})
    s.finish_tick(s.plan_tick(), {"a": Sampled(6, accepted=2)})
    (rows,) = s.plan_tick().parts
    assert (rows.position, rows.ids) == (6, (6,)) and s.view("a").computed == 6


def test_drafts_are_cut_to_leave_a_row_for_every_other_sequence():
    """Verify rows never take the rows other running sequences need: the drafts that do not fit are dropped."""
    s = scheduler(budget=4, max_seqs=3)
    for seq, start in (("a", 0), ("b", 10), ("c", 20)):
        s.add(seq, [start])
    s.finish_tick(s.plan_tick(), {"a": Sampled(1, drafts=(1, 1, 1, 1, 1)), "b": Sampled(1), "c": Sampled(1)})
    plan = s.plan_tick()
    assert [(rows.seq, rows.count, rows.want) for rows in plan.parts] == [("a", 2, 2), ("b", 1, 1), ("c", 1, 1)]
    assert s.view("a").drafts == 1 and s.view("a").ids == (0, 1, 1)


def test_pipelined_plans_continue_a_prefill_and_finish_in_order():
    """With a plan in flight, the next one carries the prompt's next chunk but no row of an awaiting sequence."""
    s = scheduler(budget=8, max_seqs=2)
    s.add("a", ids(2))
    s.add("b", ids(20, 40))
    first = s.plan_tick()
    second = s.plan_tick()
    assert [(r.seq, r.position, r.count) for r in first.parts] == [("a", 0, 2), ("b", 0, 6)]
    assert [(r.seq, r.position, r.count) for r in second.parts] == [("b", 6, 8)]
    assert s.in_flight == (0, 1)
    with pytest.raises(BatchError, match="expected tick 0, got tick 1"):
        s.finish_tick(second, {})
    s.finish_tick(first, {"a": Sampled(5)})
    s.finish_tick(second, {})
    assert s.view("b").computed == 14 and s.in_flight == ()


def test_sequence_preempted_in_flight_keeps_its_sampled_token():
    """Rows of a sequence preempted while in flight commit nothing, but the token they gave is kept."""
    s = scheduler(num_blocks=3, budget=8, max_seqs=2, prefix_cache=False)
    s.add("a", ids(4))
    s.add("b", ids(7, 20))
    first, second = s.plan_tick(), s.plan_tick()  # a 4 rows + b's first 4; b's last 3, in flight together
    s.finish_tick(first, {"a": Sampled(1)})
    third = s.plan_tick()  # a needs a 2nd block of the 3: b, the newest, is preempted with its rows in flight
    assert third.preempted == ("b",) and [rows.seq for rows in third.parts] == ["a"]
    s.add("c", [9])
    assert s.plan_tick().parts == ()  # c may not overtake b, which resumes once its result is in
    s.finish_tick(second, {"b": Sampled(2)})
    view = s.view("b")
    assert view.ids == (*ids(7, 20), 2) and view.computed == 0 and not view.admitted and view.preempted


def test_finish_checks_results_against_the_plan():
    """Extra or impossible results are refused before anything changes."""
    s = scheduler(budget=8)
    s.add("a", ids(3))
    s.add("b", ids(20, 10))
    plan = s.plan_tick()
    before = s.view("a")
    with pytest.raises(BatchError, match="hold \\['b'\\] besides"):
        s.finish_tick(plan, {"a": Sampled(1), "b": Sampled(1)})
    with pytest.raises(BatchError, match="expected 0..0 accepted"):
        s.finish_tick(plan, {"a": Sampled(1, accepted=1)})
    assert s.view("a") == before and s.in_flight == (0,)
    with pytest.raises(BatchError, match="already scheduled"):
        s.add("a", [1])


def test_results_left_out_wait_for_resume_with_drafts_rewound_by_block_table():
    """A sequence whose sampler runs elsewhere resumes later: the rejected drafts leave its table, the rest
    commit, and a later tick runs its new tail; resuming twice or unasked is refused."""
    s = scheduler(num_blocks=16, budget=40)
    s.add("a", ids(30) + [100, 101, 102], drafts=3)  # a prompt and 3 drafts: 4 logits rows wanted
    plan = s.plan_tick()
    assert plan.parts[0].want == 4 and plan.parts[0].count == 33
    s.finish_tick(plan, {})  # the head samples on a stream thread: nothing decided yet
    assert s.view("a").awaiting and s.blocks.computed("a") == 30 and s.plan_tick().parts == ()
    s.resume("a", Sampled(7, accepted=1, drafts=(8,)))  # 100 kept, 101 and 102 rewound; then 7 and a draft 8
    view = s.view("a")
    assert view.ids == (*ids(30), 100, 7, 8) and s.blocks.length("a") == 31 and s.blocks.computed("a") == 31
    rows = s.plan_tick().parts[0]
    assert (rows.position, rows.ids, rows.want) == (31, (7, 8), 2)
    with pytest.raises(BatchError, match="awaits no result"):
        s.resume("a", Sampled(1))


def test_prompt_longer_than_the_pool_is_refused_and_an_outgrown_sequence_dropped():
    """A prompt the whole pool cannot hold is refused at once; a sequence that outgrows it is dropped, not stuck."""
    s = scheduler(num_blocks=2, budget=8, max_seqs=1)
    with pytest.raises(BatchError, match="grow the pool"):
        s.add("x", ids(9))
    head = Head(s, {"a": 10})
    head.add("a", ids(7))
    dropped = [plan for plan in (head.step() for _ in range(5)) if plan.dropped]
    assert dropped[0].dropped == ("a",) and "a" not in s and s.stats.dropped == 1
    assert s.stats.blocks.used == 0


def test_rows_in_flight_of_a_cancelled_sequence_never_commit_into_its_successor():
    """A sequence cancelled and added again under its id: the old rows in flight commit nothing of the new one."""
    s = scheduler(budget=8, chunk=4)
    s.add("a", ids(10))
    old = s.plan_tick()
    s.cancel("a")
    s.add("a", ids(10, 50))
    new = s.plan_tick()
    s.finish_tick(old, {})
    assert s.view("a").computed == 0
    s.finish_tick(new, {})
    assert s.view("a").computed == 4


def test_cancel_frees_blocks_and_ignores_rows_in_flight():
    """A cancelled sequence's blocks return at once; its rows in flight finish without effect."""
    s = scheduler()
    s.add("a", ids(10))
    plan = s.plan_tick()
    s.cancel("a")
    assert s.stats.blocks.used == 0 and s.finish_tick(plan, {"a": Sampled(1, finished=True)}) == ()
    assert "a" not in s


def test_stats_report_rows_sequences_hits_blocks_and_preemptions():
    """The figures /metrics reads add up over the ticks of a run."""
    s = scheduler(num_blocks=5, budget=8, max_seqs=2)
    head = Head(s, {"a": 6, "b": 6, "c": 2})
    head.add("a", ids(6))
    head.add("b", ids(6, 20))
    head.run()
    head.add("c", ids(6))
    head.run()
    stats = s.stats
    assert stats.ticks == len(head.plans) and stats.rows == sum(plan.rows for plan in head.plans)
    assert stats.seqs == sum(len(plan.parts) for plan in head.plans)
    assert stats.rows_per_tick == stats.rows / stats.ticks and stats.blocks.hit_rate > 0
    assert stats.preemptions >= 1 and stats.running == stats.waiting == 0
    assert stats.blocks.used == 0 and stats.blocks.free + stats.blocks.cached == 5


WORKLOADS = st.fixed_dictionaries({
    "base": st.lists(st.integers(0, 2), min_size=8, max_size=8),
    "seqs": st.lists(st.tuples(st.integers(0, 8), st.lists(st.integers(0, 2), min_size=1, max_size=6),
                               st.integers(1, 10), st.integers(0, 4)), min_size=1, max_size=8),
    "num_blocks": st.integers(7, 14),  # a sequence needs up to 7 blocks of 4: 8 + 6 prompt, 10 new, 3 drafts
    "max_seqs": st.integers(1, 4),
    "extra_budget": st.integers(0, 8),
    "chunk": st.one_of(st.none(), st.integers(1, 8)),
    "prefix_cache": st.booleans(),
    "defer": st.booleans(),
    "depth": st.integers(1, 3),
    "drafts": st.integers(0, 3),
    "cancels": st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=2),  # (tick, sequence)
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WORKLOADS)
def test_random_workloads_keep_budgets_fairness_and_solo_tokens(w: dict):
    """Random arrivals, cancels, pools, budgets, chunks, pipelining and drafts: every plan keeps the budget and
    the sequence cap, serves every ready decode sequence and the older prefills first, the manager stays
    consistent, every sequence ends with its solo tokens, and every block ends free or cached."""
    budget = w["max_seqs"] + w["extra_budget"]
    s = scheduler(w["num_blocks"], budget, w["max_seqs"], w["chunk"], w["prefix_cache"], w["defer"])
    rng = random.Random(w["seed"])

    def propose(known: list[int]) -> list[int]:
        guess = solo(known, rng.randint(0, w["drafts"]))[len(known):]
        return [t if rng.random() < 0.7 else (t + 1) % VOCAB for t in guess]

    arrivals = {f"s{i}": (tick, w["base"][:k] + tail, new) for i, (k, tail, new, tick) in enumerate(w["seqs"])}
    head = Head(s, {seq: new for seq, (_, _, new) in arrivals.items()}, w["depth"], propose)
    cancelled: set[str] = set()
    for tick in range(3000):
        for seq, (at, prompt, _) in arrivals.items():
            if at == tick:
                head.add(seq, prompt)
        for seq in (f"s{i}" for at, i in w["cancels"] if at == tick):
            if seq in s:
                s.cancel(seq)
                cancelled.add(seq)
        if tick > 4 and not head.pending and not head.flight:
            break
        before = {seq: s.view(seq) for seq in arrivals if seq in s}
        plan = head.step()
        check_plan(plan, before, budget, w["max_seqs"], w["chunk"] or budget)
    else:
        raise AssertionError("sequences still unfinished after 3000 ticks")
    assert head.done.keys() == arrivals.keys() - cancelled
    for seq, ids_ in head.done.items():
        _, prompt, new = arrivals[seq]
        assert ids_[:len(prompt) + new] == solo(prompt, new), seq
    stats = s.stats.blocks
    assert stats.used == 0 and stats.free + stats.cached == w["num_blocks"]


def check_plan(plan: TickPlan, before: dict, budget: int, max_seqs: int, chunk: int) -> None:
    """The plan's rows fit the budget and cap; ready decodes all run; running prefills are served oldest first."""
    assert plan.rows <= budget and len(plan.parts) <= max_seqs
    served = {rows.seq: rows for rows in plan.parts}
    for view in before.values():
        if view.admitted and view.work in ("decode", "verify"):
            assert view.seq in served or view.seq in plan.preempted, f"{view.seq} starved"
    oldest_first = sorted(before.values(), key=lambda v: v.arrival)
    prefills = [v.seq for v in oldest_first if v.admitted and v.work == "prefill" and v.seq not in plan.preempted]
    got = [seq in served for seq in prefills]
    assert got == sorted(got, reverse=True), f"a newer prefill was served before an older one: {prefills} {got}"
    assert all(served[seq].count <= chunk for seq in prefills if seq in served)


def test_a_tick_takes_at_most_the_sequences_asked_oldest_first():
    """plan_tick(max_seqs=k): a pipeline splits its ready sequences over the ticks it keeps in flight; the
    rest stay ready for the next tick."""
    s = scheduler(budget=16, max_seqs=4)
    for name in "abc":
        s.add(name, ids(3))
    assert s.ready == 3
    first = s.plan_tick(max_seqs=2)
    assert [rows.seq for rows in first.parts] == ["a", "b"] and s.ready == 1
    second = s.plan_tick(max_seqs=2)
    assert [rows.seq for rows in second.parts] == ["c"] and s.ready == 0
