r"""A chain: one session's connections to every stage of a bundle, and the routing of their answers.

:class:`Chain` connects to every stage under one fresh session (128 random bits), from the last stage back,
telling each stage where the next one listens. A reader thread per connection hands each answer to whoever
waits for it: a Step's Result to the step waiting for its ``step`` (the Result's ``reply_to``), an OpenOk or a Pong to its asker, and over
paged stages every answer to a tick (Results tagged with a tick, BatchDone, a tick's Error) and the chain's
failure to the engine that :meth:`Chain.listen`\ s (scheduling/engine.py). A connection that fails fails
everyone waiting, with a recoverable :class:`~ovshard.errors.StageFailure`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import ssl
import threading
from collections.abc import Callable
from typing import Protocol

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.wire import protocol as p
from ovshard.runtime.wire.transport import Connection, connect

log = logging.getLogger(__name__)

Reply = p.Result | p.OpenOk | p.Pong | StageFailure  # what a waiting step or open is handed
Sink = Callable[[p.Message | StageFailure], None]  # who hears the answers to ticks and the chain's failure


class _Box(Protocol):
    """Where a reader hands an answer: a waiting asker's queue, or an Open's counter of acknowledgements."""

    def put(self, item: Reply, /) -> None: ...


class Chain:
    """One session's connections to every stage, and the routing of their answers."""

    def __init__(self, addresses: list[str], fingerprint: str, timeout: float, tls: ssl.SSLContext | None,
                 paged: bool = False, kv_blocks: int = 0) -> None:
        """``paged``: ask each stage for KV blocks (``kv_blocks``; 0: the stage's default share), so paged stages
        serve this session's ticks (stateful ones ignore it)."""
        self.addresses, self.timeout = addresses, timeout
        self.session = secrets.token_hex(16)
        self.conns: list[Connection] = []
        kv = kv_blocks if paged else None
        try:
            for i in reversed(range(len(addresses))):
                nxt = addresses[i + 1] if i + 1 < len(addresses) else None
                self.conns.insert(0, connect(addresses[i], i, fingerprint, "head", self.session, nxt, tls=tls,
                                             kv_blocks=kv))
            self.blocks = self._blocks() if paged else None
        except OvshardError:
            self.close()
            raise
        self.lock = threading.Lock()  # guards waiting and broken
        self.waiting: dict[tuple[str, int], tuple[int, _Box]] = {}  # (what, step|stream|nonce) -> ...
        self.broken: StageFailure | None = None
        self.sink: Sink | None = None  # the engine's: answers to ticks, and this chain's failure
        self.depth = len(self.conns)
        for i, conn in enumerate(self.conns):
            threading.Thread(target=self._read, args=(i, conn), daemon=True).start()

    def _blocks(self) -> BlockManager | None:
        """Block tables over the fewest blocks any stage granted, when every stage runs paged with one block size."""
        welcomes = [c.welcome for c in self.conns]
        sizes = {w.block_size if w else 0 for w in welcomes}
        if sizes == {0}:
            return None
        if len(sizes) != 1:
            raise OvshardError(f"the stages disagree on their KV cache (block sizes {sorted(sizes)}, 0 = stateful): "
                               "start every worker with the same --kv (paged or stateful)")
        blocks, size = min(w.kv_blocks for w in welcomes if w), sizes.pop()
        log.info("every stage runs paged KV: %d blocks of %d positions for this session", blocks, size)
        return BlockManager(blocks, size)

    def send_tick(self, msg: p.Batch) -> None:
        try:
            self.conns[0].send(msg)
        except OSError as e:
            raise StageFailure(f"stage 0 at {self.addresses[0]}: send failed: {e}", True) from e

    def retire(self, seq: int) -> None:
        """Nothing to do: a paged sequence's blocks are the engine's block tables' alone."""

    def listen(self, deliver: Sink) -> None:
        """Hand ``deliver`` every answer to a tick and this chain's failure (at once if it has failed)."""
        with self.lock:
            self.sink = deliver
            broken = self.broken
        if broken is not None:
            deliver(broken)

    def _for_ticks(self, msg: p.Message) -> bool:
        """Whether ``msg`` answers a tick (no step waits for its number)."""
        if self.sink is None:
            return False
        if isinstance(msg, p.BatchDone):
            return True
        if isinstance(msg, (p.Result, p.Error)) and msg.reply_to is not None:
            with self.lock:
                return ("step", msg.reply_to) not in self.waiting
        return False

    def _targets(self, msg: p.Message) -> list[_Box]:
        if isinstance(msg, p.Result):
            found = self.waiting.get(("step", msg.reply_to))
        elif isinstance(msg, p.OpenOk):
            found = self.waiting.get(("open", msg.stream))
        elif isinstance(msg, p.Pong):
            found = self.waiting.get(("ping", msg.nonce))
        elif isinstance(msg, p.Error):
            found = self.waiting.get(("step", msg.reply_to)) if msg.reply_to is not None else None
            if found is None:
                return [q for stream, q in self.waiting.values() if msg.stream in (None, stream)]
        else:
            return []
        return [found[1]] if found else []

    def _read(self, stage: int, conn: Connection) -> None:
        """Route each answer to whoever waits for it; a failed connection fails everyone waiting."""
        where = f"stage {stage} at {self.addresses[stage]}"
        try:
            while True:
                msg = conn.receive()
                if self.sink is not None and self._for_ticks(msg):
                    self.sink(msg)
                    continue
                answer: Reply = msg  # type: ignore[assignment]
                if isinstance(msg, p.Error):
                    answer = StageFailure(f"{where} reported {msg.code}: {msg.message}",
                                          msg.code in p.RECOVERABLE_CODES)
                with self.lock:
                    targets = self._targets(msg)
                for target in targets:
                    target.put(answer)
        except (p.ConnectionClosed, p.ProtocolError, OSError) as e:
            broken = StageFailure(f"{where} closed the connection: {e}", recoverable=True)
            with self.lock:
                self.broken = broken
                targets = [target for _, target in self.waiting.values()]
                sink = self.sink
            for target in targets:  # outside the lock: an Open's counter takes it to call back
                target.put(broken)
            if sink is not None:
                sink(broken)

    def ask(self, key: tuple[str, int], stream: int, sends: list[tuple[int, p.Message]],
            answers: int, timeout: float | None = None) -> list[p.Result | p.OpenOk | p.Pong]:
        """Send each (stage, message), then wait for ``answers`` answers to ``key`` (``timeout`` each)."""
        return self.ask_each([key], stream, sends, answers, timeout)[0]

    def ask_each(self, keys: list[tuple[str, int]], stream: int, sends: list[tuple[int, p.Message]],
                 answers: int = 1, timeout: float | None = None) -> list[list[p.Result | p.OpenOk | p.Pong]]:
        """Send every message at once, then wait for ``answers`` answers to each key in turn: the chunks of a
        pipelined prefill are all in flight while the first ones are still being answered."""
        boxes: list[queue.Queue[Reply]] = [queue.Queue() for _ in keys]
        with self.lock:
            if self.broken is not None:
                raise self.broken
            self.waiting.update({key: (stream, box) for key, box in zip(keys, boxes, strict=True)})
        try:
            for stage, msg in sends:
                try:
                    self.conns[stage].send(msg)
                except OSError as e:
                    raise StageFailure(f"stage {stage} at {self.addresses[stage]}: send failed: {e}", True) from e
            got: list[list[p.Result | p.OpenOk | p.Pong]] = []
            for key, box in zip(keys, boxes, strict=True):
                got.append([])
                for _ in range(answers):
                    try:
                        answer = box.get(timeout=timeout or self.timeout)
                    except queue.Empty:
                        raise OvshardError(f"no answer to {key[0]} {key[1]} of stream {stream} within "
                                           f"{self.timeout:.0f} s (stages {', '.join(self.addresses)})") from None
                    if isinstance(answer, StageFailure):
                        raise answer
                    got[-1].append(answer)
            return got
        finally:
            with self.lock:
                for key in keys:
                    self.waiting.pop(key, None)

    def open_stream(self, stream: int, opened: Callable[[StageFailure | None], None]) -> None:
        """Send Open ``stream`` to every stage and return at once; ``opened(None)`` (on a reader's thread) once
        every stage acknowledged it, or ``opened(failure)`` once one failed. Raises StageFailure if a send fails."""
        key = ("open", stream)
        box = _Acks(self.depth, lambda failure: self._opened(key, opened, failure))
        with self.lock:
            if self.broken is not None:
                raise self.broken
            self.waiting[key] = (stream, box)
        for stage, conn in enumerate(self.conns):
            try:
                conn.send(p.Open(stream))
            except OSError as e:
                with self.lock:
                    self.waiting.pop(key, None)
                raise StageFailure(f"stage {stage} at {self.addresses[stage]}: send failed: {e}", True) from e

    def _opened(self, key: tuple[str, int], opened: Callable[[StageFailure | None], None],
                failure: StageFailure | None) -> None:
        with self.lock:
            self.waiting.pop(key, None)
        opened(failure)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


class _Acks:
    """Counts the answers to an Open sent to every stage; calls ``done`` once: with None after ``count`` OpenOks,
    or with the first failure."""

    def __init__(self, count: int, done: Callable[[StageFailure | None], None]) -> None:
        self.count, self.done, self.lock, self.over = count, done, threading.Lock(), False

    def put(self, answer: Reply, /) -> None:
        with self.lock:
            if self.over:
                return
            self.count -= not isinstance(answer, StageFailure)
            self.over = isinstance(answer, StageFailure) or self.count == 0
            if not self.over:
                return
        self.done(answer if isinstance(answer, StageFailure) else None)
