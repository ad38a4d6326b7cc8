"""A paged stage's share of continuous batching: the KV block pool it grants to sessions, and one Batch run.

The head owns every block table (it runs the scheduler, scheduling/tick_planner.py) and names blocks 0..n-1 of the
n its session was granted; the stage maps them to its own pool, so a head can read and write its own blocks
only. Each row of a Batch is checked alone: a row the stage cannot run is refused (a ``Refusal`` travels on
with the batch) and the others run, in one inference.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ovshard.bundle.dims import ModelDims
from ovshard.runtime.engine.paged import PagedRows, PagedStage, blocks_for
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.node.heads import RequestError
from ovshard.runtime.wire import protocol as p

__all__ = ["BatchRun", "KVPool", "batch_answers", "batch_input", "forward_batch", "run_batch"]

GRANT_WAIT_S = 2.0  # how long a Hello waits for blocks a departing session is still returning


class KVPool:
    """The blocks of a paged stage's caches, granted to sessions whole: a session holds its grant until its
    head goes away. A head asking for 0 blocks gets half the pool (at least ``sequence`` blocks, one sequence
    of the bundle's max positions), so a second head (a benchmark's, an operator's CLI) finds room too."""

    def __init__(self, num_blocks: int, sequence: int = 1) -> None:
        self.num_blocks, self.sequence = num_blocks, min(sequence, num_blocks)
        self._free = list(range(num_blocks))
        self._changed = threading.Condition()

    @property
    def free(self) -> int:
        with self._changed:
            return len(self._free)

    def grant(self, wanted: int, wait_s: float = GRANT_WAIT_S) -> np.ndarray:
        """``wanted`` blocks (0: the default share) as an i32 map from the session's block ids to the pool's;
        waits ``wait_s`` for a session that is going away, then refuses with ``busy``."""
        share = max(self.sequence, self.num_blocks // 2)
        with self._changed:
            self._changed.wait_for(lambda: len(self._free) >= (wanted or self.sequence), timeout=wait_s)
            n = wanted or min(share, len(self._free))
            if not wanted and n < self.sequence:
                n = 0  # not even one full-length sequence: refused below
            if n == 0 or n > len(self._free):
                raise RequestError("busy", f"the paged KV cache has {len(self._free)} of {self.num_blocks} blocks "
                                           f"free and this head asks for {wanted or 'any'}: other heads hold the "
                                           "rest; start the worker with a larger --kv-blocks, or wait")
            taken, self._free = self._free[:n], self._free[n:]
        return np.array(taken, dtype=np.int32)

    def release(self, grant: np.ndarray) -> None:
        with self._changed:
            self._free.extend(int(b) for b in grant)
            self._changed.notify_all()


@dataclass
class BatchRun:
    """What one Batch did at a stage: the rows it ran (with their session-relative tables) and each row's
    output rows (hidden [T, H], or logits [R, V] at a last stage), and the rows refused here or before."""

    rows: list[p.BatchRow]
    tables: list[np.ndarray]
    outputs: list[np.ndarray]
    refused: list[p.Refusal]
    compute_s: float = 0.0


def batch_input(msg: p.Batch, stage: int, dims: ModelDims) -> np.ndarray:
    """The Batch's tensor as the stage's input: ids [N] at stage 0, hidden states [N, H] after it."""
    t = msg.tensor
    if stage == 0:
        if t.dtype not in ("i64", "i32") or len(t.shape) != 1:
            raise RequestError("failed", f"stage 0 takes token ids i64 [N], found {t.dtype}{list(t.shape)}")
        ids = t.to_array(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= dims.vocab_size):
            raise RequestError("failed", f"token ids must be in [0, {dims.vocab_size}), found "
                                         f"{int(ids.min())}..{int(ids.max())}")
        return ids
    if t.dtype not in ("f16", "f32") or len(t.shape) != 2 or t.shape[1] != dims.hidden_size:
        raise RequestError("failed", f"stage {stage} takes hidden states [N, {dims.hidden_size}] (f16 or f32), "
                                     f"found {t.dtype}{list(t.shape)}")
    return t.to_array(np.float32)


def _check_row(row: p.BatchRow, table: np.ndarray, granted: int, paged: PagedStage, writing: set[int]) -> str:
    """Why the stage cannot run ``row`` ("" when it can); ``writing``: blocks earlier rows write."""
    end = row.position + row.count
    if end > paged.max_positions:
        return (f"positions up to {end - 1} asked; the bundle's rotary table has {paged.max_positions} "
                "(compile with a larger --max-positions)")
    if len(table) != blocks_for(end, paged.block_size):
        return f"positions [0, {end}) need {blocks_for(end, paged.block_size)} blocks, the table has {len(table)}"
    if table.size and (int(table.min()) < 0 or int(table.max()) >= granted):
        return f"block ids must be in [0, {granted}) (this session's grant), found {table.min()}..{table.max()}"
    if row.want and p.rows_read(row.want, row.count) > row.count:
        return f"want {row.want!r} reads more rows than the {row.count} fed"
    written = {int(b) for b in table[row.position // paged.block_size:]}
    if written & writing:
        return f"writes block(s) {sorted(written & writing)} that an earlier row of the batch writes"
    writing |= written
    return ""


def run_batch(paged: PagedStage, grant: np.ndarray, msg: p.Batch, x: np.ndarray, stage: int,
              lock: threading.Lock) -> BatchRun:
    """Check every row, apply the copies, run the rows that pass in one inference (under ``lock``: one
    inference at a time on the stage's caches)."""
    tables = np.split(msg.tables.to_array(np.int32), np.cumsum([r.blocks for r in msg.rows])[:-1])
    inputs = np.split(x, np.cumsum([r.count for r in msg.rows])[:-1])
    run = BatchRun([], [], [], list(msg.refused))
    writing: set[int] = set()
    seqs: list[PagedRows] = []
    for row, table, rows_in in zip(msg.rows, tables, inputs, strict=True):
        reason = _check_row(row, table, len(grant), paged, writing)
        if reason:
            run.refused.append(p.Refusal(row.stream, stage, "position", f"stage {stage}: stream {row.stream}: "
                                                                        f"{reason}"))
            continue
        want = p.rows_read(row.want, row.count) if row.want else 1
        seqs.append(PagedRows(rows_in, row.position, grant[table], want if paged.sliced else None))
        run.rows.append(row)
        run.tables.append(table)
    copies = [] if msg.copies is None else msg.copies.to_array(np.int32).tolist()
    if any(not (0 <= a < len(grant) and 0 <= b < len(grant)) for a, b in copies):
        raise RequestError("failed", f"Batch {msg.tick}: block copies must name blocks in [0, {len(grant)})")
    if seqs:
        with lock:
            paged.copy_blocks((int(grant[a]), int(grant[b])) for a, b in copies)
            start = time.perf_counter()
            run.outputs = paged.run(seqs)
            run.compute_s = time.perf_counter() - start
    return run


def batch_answers(run: BatchRun, tick: int) -> list[p.Result]:
    """A last stage's answer to Batch ``tick``: one Result for each row that wants scores (the rows its want
    reads, as a Step's), tagged with the row's stream."""
    answers = []
    for row, logits in zip(run.rows, run.outputs, strict=True):
        if row.want:
            scores = Scores.from_logits(logits, row.want)
            indices = None if scores.indices is None else p.Tensor.from_array(scores.indices[None])
            values = scores.values[None]
            answers.append(p.Result(row.stream, tick, p.Tensor.from_array(values, None if values.dtype == np.int64
                                                                          else "f32"), {}, indices))
    return answers


def forward_batch(run: BatchRun, msg: p.Batch, timings: dict[str, float], hidden: int, wire_dtype: str) -> p.Batch:
    """What a stage before the last sends on: the rows it ran with their hidden states, and every refusal."""
    rows = np.concatenate(run.outputs) if run.outputs else np.zeros((0, hidden), np.float32)  # [N, H]
    tables = np.concatenate(run.tables) if run.tables else np.zeros(0, np.int32)
    return p.Batch(msg.tick, run.rows, p.Tensor.activations(rows, wire_dtype), p.Tensor.from_array(tables.astype(np.int32)),
                   msg.copies, timings, run.refused)
