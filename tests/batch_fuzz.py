"""Fuzz a paged stage worker's Batches over loopback TCP; then check it survived, still serves, leaked nothing.

    python tests/batch_fuzz.py --frames N [--seed S] [--bundle PATH]

One ``ovshard serve --kv paged --kv-blocks 64`` process (stage 0 of a one-stage fp32 stories260K bundle) takes N
frames on head sessions that asked for (and were granted) every block: Batches of 1-6 rows with random streams, positions,
counts, wants, block counts and block ids (in and out of the grant), token ids (in and out of the vocabulary),
copies, and now and then a frame with flipped bits or a cut. Every well-formed Batch is owed, in order, one
Result for each row :func:`owed` lets through that wants scores, then a BatchDone refusing exactly the other
rows; a Batch the stage must refuse whole (token ids out of range, copies outside the grant) is owed an
Error ``failed`` and the connection stays; a malformed frame is owed an Error, then a close. After the fuzz
the worker must be alive, generate the tokens it generated before, grant its whole pool to a new head (so
no session kept blocks), and have grown its RSS by at most RSS_BOUND_MB. Prints one JSON line; exits 1 on
any failure.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import bundle_fingerprint, read_manifest
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.engine.paged import blocks_for
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.framing import encode, read_message
from ovshard.runtime.wire.transport import connect

POOL = 64
BLOCK = 32
RSS_BOUND_MB = 48.0
WANTS = ("", "argmax@1", "argmax@2", "topk:3@1", "logits", "argmax@9", "topk:2@3")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def owed(rows: list[p.BatchRow], tables: list[list[int]], max_positions: int) -> list[bool]:
    """Which rows a stage runs (node/batches.py's rules restated): within the positions, a whole table of
    granted blocks, a want within the rows fed, and no block written by an earlier row that runs."""
    writing: set[int] = set()
    ok = []
    for row, table in zip(rows, tables, strict=True):
        end = row.position + row.count
        good = (end <= max_positions and len(table) == blocks_for(end, BLOCK) and all(0 <= b < POOL for b in table)
                and (not row.want or p.rows_read(row.want, row.count) <= row.count))
        written = set(table[row.position // BLOCK:]) if good else set()
        good = good and not written & writing
        if good:  # a refused row writes nothing
            writing |= written
        ok.append(good)
    return ok


class Fuzzer:
    def __init__(self, address: str, fingerprint: str, vocab: int, max_positions: int, seed: int) -> None:
        self.address, self.fingerprint, self.vocab, self.max_positions = address, fingerprint, vocab, max_positions
        self.rng = random.Random(seed)
        self.sock: socket.socket | None = None
        self.counts = {"frames": 0, "batches": 0, "results": 0, "refused_rows": 0, "refused_batches": 0,
                       "malformed": 0, "sessions": 0}
        self.failures: list[str] = []

    def session(self) -> socket.socket:
        if self.sock is None:
            conn = connect(self.address, 0, self.fingerprint, "head", secrets.token_hex(16), kv_blocks=POOL)
            assert conn.welcome is not None and conn.welcome.kv_blocks == POOL, conn.welcome
            self.sock = conn.sock
            self.sock.settimeout(30)
            self.counts["sessions"] += 1
        return self.sock

    def batch(self, seq: int) -> tuple[p.Batch, list[list[int]], bool]:
        """A random Batch, its tables, and whether its token ids are all in the vocabulary."""
        r = self.rng
        rows, tables, ids = [], [], []
        for _ in range(r.randint(1, 6)):
            position, count = r.choice((0, r.randint(0, 2 * self.max_positions))), r.randint(1, 8)
            need = blocks_for(position + count, BLOCK)
            n = need if r.random() < 0.8 else max(0, need + r.choice((-1, 1)))
            table = [r.randrange(POOL) if r.random() < 0.97 else r.randint(-3, POOL + 3) for _ in range(min(n, 400))]
            rows.append(p.BatchRow(r.randrange(10), position, count, r.choice(WANTS), len(table)))
            tables.append(table)
            ids += [r.randrange(self.vocab) for _ in range(count)]
        in_vocab = r.random() < 0.95
        if not in_vocab:
            ids[r.randrange(len(ids))] = r.choice((-1, self.vocab, 2**40))
        copies = None
        if r.random() < 0.1:
            copies = p.Tensor.from_array(np.array([[r.randint(-1, POOL), r.randint(0, POOL)]], dtype=np.int32))
        flat = np.array([b for t in tables for b in t], dtype=np.int32)
        msg = p.Batch(seq, rows, p.Tensor.from_array(np.array(ids, dtype=np.int64)), p.Tensor.from_array(flat), copies)
        whole = in_vocab and (copies is None or all(0 <= v < POOL for v in copies.to_array().ravel()))
        return msg, tables, whole

    def one(self, seq: int) -> None:
        sock = self.session()
        msg, tables, whole = self.batch(seq)
        data = encode(msg)
        self.counts["frames"] += 1
        if self.rng.random() < 0.03:  # a malformed frame: flipped bits or a cut
            self.counts["malformed"] += 1
            data = bytearray(data)
            for _ in range(3):
                data[self.rng.randrange(16, len(data))] ^= 1 << self.rng.randrange(8)
            sock.sendall(bytes(data[:self.rng.randint(16, len(data))]) if self.rng.random() < 0.3 else bytes(data))
            self.drop()
            return
        sock.sendall(data)
        self.counts["batches"] += 1
        if not whole:
            reply = read_message(sock)
            if not (isinstance(reply, p.Error) and reply.code == "failed" and reply.reply_to == seq):
                self.failures.append(f"batch {seq}: expected Error failed, got {reply}")
            self.counts["refused_batches"] += 1
            return
        ok = owed(msg.rows, tables, self.max_positions)
        for row, good in zip(msg.rows, ok, strict=True):
            if good and row.want:
                reply = read_message(sock)
                rows = p.rows_read(row.want, row.count)
                if not (isinstance(reply, p.Result) and reply.stream == row.stream and reply.reply_to == seq
                        and reply.tensor.shape[:2] == (1, rows)):
                    self.failures.append(f"batch {seq} row {row}: expected a Result of {rows} rows, got {reply}")
                    return self.drop()
                self.counts["results"] += 1
        done = read_message(sock)
        refused = sorted(row.stream for row, good in zip(msg.rows, ok, strict=True) if not good)
        if not (isinstance(done, p.BatchDone) and done.tick == seq and sorted(r.stream for r in done.refused) == refused):
            self.failures.append(f"batch {seq}: expected BatchDone refusing streams {refused}, got {done}")
            return self.drop()
        self.counts["refused_rows"] += len(refused)

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def run(frames: int, seed: int, bundle: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if bundle is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from conftest import STORIES, compile_fp32

            bundle = compile_fp32(STORIES, Path(tmp) / "b1", stages=1)
        manifest = read_manifest(bundle)
        worker = WorkerProcess(serve_command(bundle, 0, "127.0.0.1:0", ["--exact", "--kv", "paged", "--kv-blocks",
                                                                      str(POOL), "--frame-timeout", "5"]), 0)
        try:
            address = worker.wait_listening(120)
            prompt = [1, 403, 407, 261, 378]

            def generate() -> list[int]:
                head = Head(bundle, [address])
                try:
                    return list(head.generate(prompt, SamplingConfig(max_tokens=30)))
                finally:
                    head.close()

            before = generate()
            fuzz = Fuzzer(address, bundle_fingerprint(bundle), manifest.architecture.vocab_size,
                          manifest.runtime_hints.max_positions, seed)
            for seq in range(min(frames, 2000)):  # warm-up: the allocator's high-water mark
                fuzz.one(seq)
            rss0 = rss_mb(worker.process.pid)
            for seq in range(2000, frames):
                fuzz.one(seq)
            fuzz.drop()
            alive = worker.process.poll() is None
            report = {**fuzz.counts, "failures": len(fuzz.failures), "worker_alive": alive,
                      "rss_growth_mb": round(rss_mb(worker.process.pid) - rss0, 1) if alive else None,
                      "same_generation": alive and generate() == before}
            if alive:  # the whole pool comes back to one new head: no session kept blocks
                conn = connect(address, 0, bundle_fingerprint(bundle), "head", secrets.token_hex(16), kv_blocks=POOL)
                report["pool_whole"] = conn.welcome is not None and conn.welcome.kv_blocks == POOL
                conn.close()
            for failure in fuzz.failures[:20]:
                print(failure, file=sys.stderr)
            return report
        finally:
            worker.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", type=Path)
    args = parser.parse_args()
    report = run(args.frames, args.seed, args.bundle)
    print(json.dumps(report))
    good = (report["failures"] == 0 and report["worker_alive"] and report["same_generation"]
            and report.get("pool_whole") and report["rss_growth_mb"] <= RSS_BOUND_MB)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
