"""The KV block manager of a paged stage: which cache blocks hold which sequence's positions. Pure Python.

A paged stage (paged.py) holds ``num_blocks`` blocks of ``block_size`` positions in every layer's key and
value cache. A sequence's **block table** lists the blocks that hold its positions, in order: position ``p``
lives in slot ``p % block_size`` of block ``table[p // block_size]``, so a table of ``length`` positions has
``ceil(length / block_size)`` blocks. This module decides the tables; the stage only reads them.

Every block is in exactly one of three states::

    in use   referenced by refs[b] >= 1 block tables
    cached   referenced by none, full of a known prefix's KV and registered under its key: reusable by a
             later sequence with that prefix, evicted when the pool runs short (least recently released first)
    free     referenced by none, holding nothing anyone can find

    available = free + cached        used = num_blocks - available

**Prefix keys.** The key of a sequence's full block ``i`` is a hash chain over token ids::

    key_0 = H(root || ids[0 : bs]),    key_i = H(key_(i-1) || ids[i*bs : (i+1)*bs])

with H = BLAKE2b-128 over the ids as little-endian int64 and ``root`` a namespace (empty by default). A key
names the block's tokens, every token before them, and so its positions [i*bs, (i+1)*bs): everything its KV
depends on. Every stage of a pipeline computes the same keys from the token ids the head sends, so all stages
agree on which prefix blocks are cached without talking to each other. Only full blocks whose KV was computed
(``commit``) are registered; a prefix hit never covers a sequence's last token, which must be computed for
its logits: at most ``(len(ids) - 1) // bs`` blocks are reused.

**Copy-on-write.** Blocks are shared by prefix hits and by ``fork``. A full shared block is only ever read.
A partial last block is written by the next ``append``; when it is shared (after ``fork``, or after
``truncate`` cut back into a shared prefix block) the append takes a fresh block for this sequence and
returns the copy ``(src, dst)`` that the stage applies to every layer's caches before its next inference
(``PagedStage.copy_blocks``). A partial last block held by this sequence alone but registered in the prefix
cache (a truncation into a cached block) is unregistered and written in place: its old content is gone.

**Rewind.** ``truncate(seq, length)`` is exact: the positions past ``length`` are forgotten, blocks left empty
go back (a registered one to the cached list, where it stays reusable, the rest to the free list); the stale
KV slots of the kept last block are never read again, because attention reads ``past_lens`` positions only,
and the next append overwrites them.

**Full pool.** ``allocate``/``append`` return :class:`NoBlocks` (and change nothing) when the pool cannot hold
the request: the caller lets the sequence wait, or frees (preempts) another sequence and retries.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ovshard.errors import ConfigError, OvshardError
from ovshard.runtime.engine.paged import blocks_for

__all__ = ["BlockKey", "BlockManager", "BlockStats", "BlockTableError", "Granted", "NoBlocks", "blocks_for",
           "prefix_keys"]

log = logging.getLogger(__name__)

BlockKey = bytes  # 16 bytes: BLAKE2b-128 of (parent key, the block's token ids)
_KEY_BYTES = 16


class BlockTableError(OvshardError):
    """A block manager call outside its contract (an unknown or repeated sequence, a length it does not have):
    a bug in the caller, reported before anything changes."""


def prefix_keys(ids: Sequence[int], block_size: int, parent: BlockKey = b"") -> list[BlockKey]:
    """The keys of the full blocks of ``ids``, chained on ``parent`` (the root, or the key of the block before
    ``ids[0]``): key_i = BLAKE2b-128(key_(i-1) || ids of block i as little-endian int64). A trailing partial
    block has no key."""
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        chunk = struct.pack(f"<{block_size}q", *ids[start:start + block_size])
        parent = hashlib.blake2b(parent + chunk, digest_size=_KEY_BYTES).digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Granted:
    """A call that succeeded: the sequence's whole block table now; ``cached``: its leading positions whose KV
    is already in the cache (after ``allocate``, the prefix hit: compute from there, ``past_lens = cached``);
    ``copies``: (src, dst) blocks to copy in every layer's caches before the next inference (copy-on-write)."""

    blocks: tuple[int, ...]
    cached: int
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class NoBlocks:
    """The pool cannot hold the request now: it needs ``needed`` blocks and ``available`` are free or
    evictable. Nothing changed: let the sequence wait, or free (preempt) another sequence and retry."""

    needed: int
    available: int


@dataclass(frozen=True)
class BlockStats:
    """The pool and the prefix cache: blocks in use, cached (evictable), free; tokens looked up and hit at
    ``allocate``; blocks evicted from the prefix cache."""

    used: int
    cached: int
    free: int
    lookup_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass
class _Table:
    """One sequence: the ids of positions [0, length), its blocks, how many positions hold computed KV, and
    the keys of the full computed blocks (the chain to continue)."""

    ids: list[int]
    blocks: list[int]
    computed: int = 0
    keys: list[BlockKey] = field(default_factory=list)


class BlockManager:
    """Block tables per sequence over a pool of ``num_blocks`` blocks of ``block_size`` positions.

    ``bytes_per_token``: the KV bytes one position takes in the stage's caches (PagedStage.bytes_per_token),
    for reporting only. ``prefix_cache=False`` disables lookups and registration (every block is private).
    """

    def __init__(self, num_blocks: int, block_size: int = 32, bytes_per_token: int = 0, prefix_cache: bool = True,
                 root: BlockKey = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} blocks "
                              f"of {block_size}; size the pool from the memory the KV cache may take")
        self.num_blocks, self.block_size, self.bytes_per_token = num_blocks, block_size, bytes_per_token
        self.prefix_cache, self.root = prefix_cache, root
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self._key_of: dict[int, BlockKey] = {}  # registered blocks (in use or cached) -> key
        self._by_key: dict[BlockKey, int] = {}
        self._tables: dict[Hashable, _Table] = {}
        self._lookup_tokens = self._hit_tokens = self._evictions = 0

    # --- accounting --------------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks a request can get now: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def used_bytes(self) -> int:
        return self.used * self.bytes_per_block

    @property
    def stats(self) -> BlockStats:
        return BlockStats(self.used, len(self._lru), len(self._free), self._lookup_tokens, self._hit_tokens,
                          self._evictions)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._tables

    def blocks(self, seq: Hashable) -> tuple[int, ...]:
        return tuple(self._table(seq).blocks)

    def length(self, seq: Hashable) -> int:
        return len(self._table(seq).ids)

    def computed(self, seq: Hashable) -> int:
        return self._table(seq).computed

    def refs(self, block: int) -> int:
        return self._refs[block]

    # --- the calls a scheduler makes ----------------------------------------------------------------------

    def can_allocate(self, seq: Hashable, ids: Sequence[int]) -> bool:
        """Whether ``allocate`` (a new ``seq``) or ``append`` (a known one) of ``ids`` would succeed now."""
        needed, available = self._need(seq, ids)
        return needed <= available

    def allocate(self, seq: Hashable, ids: Sequence[int]) -> Granted | NoBlocks:
        """A table for new sequence ``seq`` holding ``ids``: cached prefix blocks reused (refcount + 1), fresh
        blocks for the rest. ``Granted.cached`` positions need no compute."""
        if seq in self._tables:
            raise BlockTableError(f"sequence {seq!r} already has a table of {self.length(seq)} positions; "
                                  "append to it, or free it first")
        if not ids:
            raise BlockTableError(f"sequence {seq!r}: allocate needs at least one token id, got none")
        hits, keys = self._lookup(ids)
        needed, available = self._need(seq, ids)
        if needed > available:
            return NoBlocks(needed, available)
        for block in hits:
            self._acquire(block)
        table = _Table(list(ids), hits + [self._take() for _ in range(needed)], len(hits) * self.block_size,
                       keys[:len(hits)])
        self._tables[seq] = table
        self._lookup_tokens += len(ids)
        self._hit_tokens += table.computed
        return Granted(tuple(table.blocks), table.computed)

    def append(self, seq: Hashable, ids: Sequence[int]) -> Granted | NoBlocks:
        """Room for ``ids`` after ``seq``'s positions (decode rows, draft rows, a prefill chunk): fresh blocks
        as needed, and a copy of a shared partial last block (copy-on-write)."""
        table = self._table(seq)
        needed, available = self._need(seq, ids)
        if needed > available:
            return NoBlocks(needed, available)
        copies: tuple[tuple[int, int], ...] = ()
        if ids and len(table.ids) % self.block_size:  # the first new id goes into the last block
            last = table.blocks[-1]
            if self._refs[last] > 1:
                copies = ((last, self._take()),)
                table.blocks[-1] = copies[0][1]
                self._release(last)
                needed -= 1
            else:
                self._unregister(last)  # ours alone: written in place, so its cached content is gone
        table.blocks.extend(self._take() for _ in range(needed))
        table.ids.extend(ids)
        return Granted(tuple(table.blocks), table.computed, copies)

    def commit(self, seq: Hashable, upto: int | None = None) -> None:
        """Positions [0, upto) of ``seq`` (default: all) now hold computed KV: their full blocks join the
        prefix cache under their keys (a key already cached elsewhere keeps its first block)."""
        table = self._table(seq)
        upto = len(table.ids) if upto is None else upto
        if not 0 <= upto <= len(table.ids):
            raise BlockTableError(f"sequence {seq!r} has {len(table.ids)} positions; cannot commit {upto}")
        table.computed = max(table.computed, upto)
        if not self.prefix_cache:
            return
        done = len(table.keys) * self.block_size
        parent = table.keys[-1] if table.keys else self.root
        new = prefix_keys(table.ids[done:table.computed], self.block_size, parent)
        for i, key in enumerate(new, start=len(table.keys)):
            block = table.blocks[i]
            if key not in self._by_key and block not in self._key_of:
                self._key_of[block], self._by_key[key] = key, block
        table.keys.extend(new)

    def truncate(self, seq: Hashable, length: int) -> tuple[int, ...]:
        """Forget ``seq``'s positions from ``length`` on (a speculative rewind): exact; blocks left empty go
        back to the pool, last block first. Returns the blocks released."""
        table = self._table(seq)
        if not 0 <= length <= len(table.ids):
            raise BlockTableError(f"sequence {seq!r} has {len(table.ids)} positions; cannot truncate to {length}")
        keep = blocks_for(length, self.block_size)
        dropped = tuple(table.blocks[keep:])
        for block in reversed(dropped):
            self._release(block)
        del table.blocks[keep:], table.ids[length:], table.keys[length // self.block_size:]
        table.computed = min(table.computed, length)
        return dropped

    def fork(self, parent: Hashable, child: Hashable) -> Granted:
        """``child`` starts as a copy of ``parent``, sharing every block (refcount + 1); the first append to a
        shared partial last block copies it."""
        if child in self._tables:
            raise BlockTableError(f"cannot fork into sequence {child!r}: it already has a table; free it first")
        table = self._table(parent)
        for block in table.blocks:
            self._refs[block] += 1
        self._tables[child] = _Table(list(table.ids), list(table.blocks), table.computed, list(table.keys))
        return Granted(tuple(table.blocks), table.computed)

    def free(self, seq: Hashable) -> None:
        """Drop ``seq``'s table. Its blocks go back last first, so a cached prefix's tail is evicted before its
        head (a head without its tail still serves shorter prefixes; a tail without its head serves nothing)."""
        table = self._tables.pop(seq, None)
        if table is None:
            raise BlockTableError(f"sequence {seq!r} has no block table (never allocated, or freed already)")
        for block in reversed(table.blocks):
            self._release(block)

    def check(self) -> None:
        """Raise BlockTableError if the bookkeeping is inconsistent (for tests and debugging)."""
        counted = [0] * self.num_blocks
        for table in self._tables.values():
            if len(table.blocks) != blocks_for(len(table.ids), self.block_size):
                raise BlockTableError(f"a table of {len(table.ids)} positions holds {len(table.blocks)} blocks")
            for block in table.blocks:
                counted[block] += 1
        problems = [f"block {b}: refs {self._refs[b]}, held by {counted[b]} tables" for b in range(self.num_blocks)
                    if self._refs[b] != counted[b]]
        idle = set(self._free) | set(self._lru)
        problems += [f"block {b} is both idle and in a table" for b in idle if counted[b]]
        problems += [f"block {b} is neither idle nor in a table" for b in range(self.num_blocks)
                     if not counted[b] and b not in idle]
        problems += [f"free block {b} is registered" for b in self._free if b in self._key_of]
        problems += [f"cached block {b} is not registered" for b in self._lru if b not in self._key_of]
        if len(self._free) + len(self._lru) != len(idle) or len(self._key_of) != len(self._by_key):
            raise BlockTableError("a block is listed twice among the idle ones, or the key index is not "
                                  "one-to-one")
        if problems:
            raise BlockTableError("; ".join(problems[:5]))

    # --- internals ----------------------------------------------------------------------------------------

    def _table(self, seq: Hashable) -> _Table:
        table = self._tables.get(seq)
        if table is None:
            raise BlockTableError(f"sequence {seq!r} has no block table; allocate one first")
        return table

    def _lookup(self, ids: Sequence[int]) -> tuple[list[int], list[BlockKey]]:
        """The cached blocks of the longest registered prefix of ``ids`` (never its last id), and the keys."""
        if not self.prefix_cache:
            return [], []
        reusable = (len(ids) - 1) // self.block_size * self.block_size
        keys = prefix_keys(ids[:reusable], self.block_size, self.root)
        hits = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            hits.append(block)
        return hits, keys

    def _need(self, seq: Hashable, ids: Sequence[int]) -> tuple[int, int]:
        """(blocks the request takes from the pool, blocks the pool can give it)."""
        table = self._tables.get(seq)
        if table is None:
            hits, _ = self._lookup(ids)
            revived = sum(1 for block in hits if block in self._lru)  # hits taken out of the cached list
            return blocks_for(len(ids), self.block_size) - len(hits), self.available - revived
        length = len(table.ids)
        copy = bool(ids) and length % self.block_size != 0 and self._refs[table.blocks[-1]] > 1
        return blocks_for(length + len(ids), self.block_size) - len(table.blocks) + copy, self.available

    def _acquire(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._lru[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise BlockTableError(f"block {block} released with no references left")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    def _take(self) -> int:
        """A block for new KV: a free one, else the least recently released cached one (evicted)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)
            self._unregister(block)
            self._evictions += 1
        self._refs[block] = 1
        return block

    def _unregister(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._by_key[key]
