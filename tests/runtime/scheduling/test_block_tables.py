"""The KV block manager (runtime/scheduling/block_tables.py): block tables, the prefix cache, copy-on-write, rewinds.

Pure bookkeeping, no OpenVINO. The property test drives random calls against a shadow of what a stage would
have written into each block slot, so a block shared wrongly (written by one sequence while another reads it)
shows as a sequence whose computed positions no longer hold its own token ids.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ovshard.runtime.engine.paged import blocks_for
from ovshard.runtime.scheduling.block_tables import (
    BlockManager,
    BlockTableError,
    Granted,
    NoBlocks,
    prefix_keys,
)

BS = 4  # positions a block in these tests
SEQS = st.sampled_from("abcde")


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def granted(result: Granted | NoBlocks) -> Granted:
    assert isinstance(result, Granted), result
    return result


def test_prefix_keys_name_the_whole_prefix():
    """Keys of the same prefix agree, one changed id changes its block's key and every later one."""
    a = prefix_keys(ids(10), BS)
    assert len(a) == 2  # the partial third block has no key
    assert a == prefix_keys(ids(8), BS) == prefix_keys(ids(11), BS)[:2]
    changed = prefix_keys([0, 1, 2, 3, 4, 99, 6, 7], BS)
    assert changed[0] == a[0] and changed[1] != a[1]
    assert prefix_keys(ids(4, 4), BS, parent=a[0]) == a[1:2]  # chained on the key before
    assert prefix_keys(ids(8), BS, parent=b"model-b") != a  # the root separates namespaces


def test_allocate_takes_ceil_blocks_and_reports_bytes():
    """A new sequence of n ids takes ceil(n / bs) blocks; the counts and bytes follow."""
    m = BlockManager(8, BS, bytes_per_token=256)
    g = granted(m.allocate("a", ids(9)))
    assert len(g.blocks) == blocks_for(9, BS) == 3 and g.cached == 0 and g.copies == ()
    assert (m.used, m.available, m.bytes_per_block, m.used_bytes) == (3, 5, 1024, 3072)
    assert m.length("a") == 9 and m.computed("a") == 0
    m.check()


def test_committed_prefix_is_reused_and_refcounted():
    """A second sequence sharing two full committed blocks reuses them and computes only the rest."""
    m = BlockManager(8, BS)
    a = granted(m.allocate("a", ids(10)))
    m.commit("a")
    b = granted(m.allocate("b", ids(8) + [50, 51, 52]))
    assert b.cached == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] not in a.blocks
    assert [m.refs(x) for x in a.blocks] == [2, 2, 1]
    assert m.stats.hit_tokens == 8 and m.stats.lookup_tokens == 21
    m.check()


def test_hit_never_covers_the_last_id():
    """A prompt entirely cached still computes its last block, whose last row gives the next token's logits."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(8)))
    m.commit("a")
    assert granted(m.allocate("b", ids(8))).cached == 4


def test_uncommitted_blocks_are_not_hits():
    """Blocks whose KV is not computed yet (no commit) are never offered to another sequence."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(8)))
    assert granted(m.allocate("b", ids(9))).cached == 0
    m.commit("a", upto=5)  # a chunked prefill: only block 0 is whole
    assert granted(m.allocate("c", ids(9))).cached == 4


def test_same_prefix_computed_twice_keeps_one_cached_copy():
    """Two sequences that computed one prefix in the same tick: its key keeps the first block; the other is private."""
    m = BlockManager(8, BS)
    a, b = granted(m.allocate("a", ids(6))), granted(m.allocate("b", ids(6)))
    m.commit("a")
    m.commit("b")
    m.free("a")
    m.free("b")
    assert (m.stats.cached, m.stats.free) == (1, 7)
    assert granted(m.allocate("c", ids(6))).blocks[0] == a.blocks[0] != b.blocks[0]
    m.check()


def test_free_returns_private_blocks_and_keeps_cached_ones():
    """Freeing a sequence puts its registered blocks on the cached list and the others on the free list."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(10)))
    m.commit("a")
    m.free("a")
    assert (m.used, m.stats.cached, m.stats.free) == (0, 2, 6)
    assert granted(m.allocate("b", ids(9))).cached == 8  # still reusable after its owner left
    m.check()


def test_lru_evicts_least_recently_released_first():
    """With no free block left, the cached block released longest ago goes first, a prefix's tail before its head."""
    m = BlockManager(4, BS)
    for seq, start in (("a", 0), ("b", 100)):
        granted(m.allocate(seq, ids(8, start)))
        m.commit(seq)
        m.free(seq)  # a released first (tail, then head), then b
    assert m.stats.cached == 4 and m.stats.free == 0
    granted(m.allocate("c", ids(1, 500)))  # evicts a's tail block
    assert m.stats.evictions == 1
    assert granted(m.allocate("a2", ids(5))).cached == 4  # a's head still hits; its 2nd block evicts b's tail
    assert m.stats.evictions == 2
    m.free("c")
    assert granted(m.allocate("b2", ids(5, 100))).cached == 4  # b's head was released last: still there
    m.check()


def test_full_pool_says_no_blocks_and_changes_nothing():
    """A request the pool cannot hold gets NoBlocks (needed, available) and leaves every table as it was."""
    m = BlockManager(3, BS)
    granted(m.allocate("a", ids(8)))
    before = (m.stats, m.blocks("a"))
    assert not m.can_allocate("b", ids(8))
    assert m.allocate("b", ids(8)) == NoBlocks(needed=2, available=1)
    assert m.append("a", ids(5, 8)) == NoBlocks(needed=2, available=1)
    assert (m.stats, m.blocks("a"), m.length("a")) == before + (8,)
    m.free("a")  # preempt a: b fits now
    assert granted(m.allocate("b", ids(8))).blocks
    m.check()


def test_truncate_is_exact_and_frees_emptied_blocks():
    """A rewind shortens the table to the blocks its length needs; the emptied block goes back to the pool."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(6)))
    m.commit("a")
    granted(m.append("a", ids(4, 6)))  # 10 positions, 3 blocks
    dropped = m.truncate("a", 7)
    assert len(dropped) == 1 and m.length("a") == 7 and len(m.blocks("a")) == 2
    assert m.computed("a") == 6 and m.stats.free == 6
    assert granted(m.append("a", [70])).copies == ()  # its own partial block: written in place
    m.check()


def test_append_into_shared_block_copies_it():
    """Fork, then append: the shared partial last block is copied (copy-on-write); full blocks stay shared."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(6)))
    m.commit("a")
    m.fork("a", "b")
    a_blocks = m.blocks("a")
    g = granted(m.append("b", [60]))
    assert g.copies == ((a_blocks[1], g.blocks[1]),) and g.blocks[0] == a_blocks[0]
    assert m.blocks("a") == a_blocks and m.refs(a_blocks[1]) == 1 and m.refs(a_blocks[0]) == 2
    assert granted(m.append("a", [61])).copies == ()  # a holds its block alone now
    m.check()


def test_truncate_into_shared_prefix_then_append_copies():
    """A rewind back into a block another sequence shares leaves it intact: the next append copies it."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(9)))
    m.commit("a")
    b = granted(m.allocate("b", ids(8) + [90, 91]))
    m.truncate("b", 6)
    g = granted(m.append("b", [92]))
    assert g.copies == ((b.blocks[1], g.blocks[1]),)
    assert m.blocks("a")[1] == b.blocks[1] and m.refs(b.blocks[1]) == 1
    m.check()


def test_truncate_into_own_cached_block_unregisters_it_on_write():
    """A cached block held by one sequence alone is written in place after a rewind, and no longer hits."""
    m = BlockManager(8, BS)
    granted(m.allocate("a", ids(9)))
    m.commit("a")
    m.truncate("a", 6)
    assert granted(m.append("a", [77])).copies == ()
    assert granted(m.allocate("b", ids(9))).cached == 4  # block 1 no longer holds ids 4..7
    m.check()


def test_contract_breaches_raise_before_changing_anything():
    """Unknown sequences, a second allocate, lengths beyond the table: BlockTableError saying what was expected."""
    m = BlockManager(4, BS)
    granted(m.allocate("a", ids(3)))
    with pytest.raises(BlockTableError, match="already has a table"):
        m.allocate("a", ids(3))
    with pytest.raises(BlockTableError, match="no block table"):
        m.append("x", [1])
    with pytest.raises(BlockTableError, match="cannot truncate to 4"):
        m.truncate("a", 4)
    with pytest.raises(BlockTableError, match="cannot commit 9"):
        m.commit("a", 9)
    with pytest.raises(BlockTableError, match="already has a table"):
        m.fork("a", "a")
    m.check()


class Tables(RuleBasedStateMachine):
    """Random calls on a 12-block pool of 4-position blocks, ids from {0, 1} so that prefixes collide.

    ``slots`` is what a stage would hold: the id written into each (block, slot) when a sequence's positions
    are computed (commit), and copied blocks on copy-on-write."""

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(12, BS)
        self.slots: dict[tuple[int, int], int] = {}
        self.ids: dict[str, list[int]] = {}

    def _apply(self, result: Granted) -> None:
        """Copy-on-write: the stage copies whole blocks."""
        for src, dst in result.copies:
            for slot in range(BS):
                if (src, slot) in self.slots:
                    self.slots[dst, slot] = self.slots[src, slot]

    @rule(seq=SEQS, new=st.lists(st.integers(0, 1), min_size=1, max_size=9), compute=st.booleans())
    def allocate(self, seq: str, new: list[int], compute: bool) -> None:
        if seq not in self.ids:
            result = self.m.allocate(seq, new)
            if isinstance(result, Granted):
                self.ids[seq] = list(new)
                self._apply(result)
                if compute:
                    self.commit(seq)

    @rule(seq=SEQS, new=st.lists(st.integers(0, 1), max_size=6), compute=st.booleans())
    def append(self, seq: str, new: list[int], compute: bool) -> None:
        if seq in self.ids:
            result = self.m.append(seq, new)
            if isinstance(result, Granted):
                self.ids[seq] += new
                self._apply(result)
                if compute:
                    self.commit(seq)

    @rule(seq=SEQS)
    def commit(self, seq: str) -> None:
        """The stage computed the new positions: their ids land in their blocks' slots."""
        if seq in self.ids:
            table = self.m.blocks(seq)
            for p in range(self.m.computed(seq), len(self.ids[seq])):
                self.slots[table[p // BS], p % BS] = self.ids[seq][p]
            self.m.commit(seq)

    @rule(seq=SEQS, keep=st.floats(0, 1))
    def truncate(self, seq: str, keep: float) -> None:
        if seq in self.ids:
            length = int(keep * len(self.ids[seq]))
            self.m.truncate(seq, length)
            del self.ids[seq][length:]

    @rule(parent=SEQS, child=SEQS)
    def fork(self, parent: str, child: str) -> None:
        if parent in self.ids and child not in self.ids:
            self.m.fork(parent, child)
            self.ids[child] = list(self.ids[parent])

    @rule(seq=SEQS)
    def free(self, seq: str) -> None:
        if seq in self.ids:
            self.m.free(seq)
            del self.ids[seq]

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        """Refcounts match the tables, never negative; no block both idle and in a table (BlockManager.check)."""
        self.m.check()
        assert all(self.m.refs(b) >= 0 for b in range(self.m.num_blocks))

    @invariant()
    def computed_positions_hold_their_own_ids(self) -> None:
        """No sequence's computed KV was overwritten by another sequence, whatever was shared."""
        for seq, held in self.ids.items():
            table = self.m.blocks(seq)
            for p in range(self.m.computed(seq)):
                assert self.slots.get((table[p // BS], p % BS)) == held[p], (seq, p)

    def teardown(self) -> None:
        """Freeing every sequence returns every block: the registered ones to the cached list, the rest free."""
        for seq in list(self.ids):
            self.m.free(seq)
        stats = self.m.stats
        assert stats.used == 0 and stats.free + stats.cached == self.m.num_blocks
        self.m.check()


TestTables = Tables.TestCase
TestTables.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
