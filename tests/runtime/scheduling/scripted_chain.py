"""The engine's test doubles (for test_engine.py and test_engine_stateful.py): a scripted chain that answers its
ticks in process.

The double is of the transport only: :class:`ScriptedLink` splits each Batch into its rows and answers every row
that wants scores as a last stage would, from a fixed next-token rule (``NEXT``), so a request's solo answer is
known; it can hold its answers (to cancel mid-flight), fail a tick, or refuse a row. The planner, the block
tables, the accept rule and the requests are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from ovshard.errors import OvshardError, StageFailure
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.block_tables import BlockManager
from ovshard.runtime.scheduling.engine import Engine
from ovshard.runtime.scheduling.links import Deliver
from ovshard.runtime.scheduling.requests import Phase, Request
from ovshard.runtime.scheduling.ticks import tick_budget
from ovshard.runtime.wire import protocol as p

VOCAB, MAX_POSITIONS, BS = 64, 256, 4
W, PF, DE, PE, RE, FI = (Phase.WAITING, Phase.PREFILLING, Phase.DECODING, Phase.PREEMPTED, Phase.REPLAYING,
                         Phase.FINISHED)


def NEXT(token: int) -> int:  # noqa: N802  the scripted model: the token after ``token``
    return (token * 5 + 1) % (VOCAB - 2) + 2


def solo(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = NEXT(last)
        out.append(last)
    return out


Answer = p.Message | StageFailure


class HeldAnswers:
    """What the scripted doubles share: answers go to the engine's ``deliver`` at once, or, while ``hold``, wait in
    ``held`` (one list per tick or step) until :meth:`release`."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.held: list[list[Answer]] = []
        self.deliver: Deliver | None = None

    def listen(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def release(self) -> None:
        held, self.held = self.held, []
        for answers in held:
            self._give(answers)

    def _answer(self, answers: list[Answer]) -> None:
        if self.hold:
            self.held.append(answers)
        else:
            self._give(answers)

    def _give(self, answers: list[Answer]) -> None:
        assert self.deliver is not None
        for answer in answers:
            self.deliver(answer)


class ScriptedLink(HeldAnswers):
    """A chain of ``depth`` stages in process: answers each Batch's rows by ``NEXT`` (argmax ids, or top-k with
    the right id first); ``hold`` keeps answers until :meth:`release`; ``fail_tick`` / ``refuse`` script faults."""

    def __init__(self, blocks: int = 64, depth: int = 2, hold: bool = False) -> None:
        super().__init__(hold)
        self.depth, self.blocks = depth, BlockManager(blocks, BS)
        self.sent: list[p.Batch] = []
        self.fail_tick: int | None = None
        self.refuse: tuple[int, int] | None = None  # (tick, row index) to refuse
        self.closed = False
        self.retired: list[int] = []  # sequences the engine said it is done with
        self.changed = threading.Condition()

    def close(self) -> None:
        self.closed = True

    def retire(self, seq: int) -> None:
        self.retired.append(seq)

    def send_tick(self, batch: p.Batch) -> None:
        with self.changed:
            self.sent.append(batch)
            self.changed.notify_all()
        self._answer(self._answers(batch))

    def wait_sent(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.sent) >= n, timeout=30), f"{len(self.sent)} ticks sent"

    def _answers(self, batch: p.Batch) -> list[Answer]:
        if self.fail_tick == len(self.sent) - 1:
            return [StageFailure(f"tick {batch.tick} lost", recoverable=True)]
        ids = batch.tensor.to_array().tolist()
        out: list[p.Message | StageFailure] = []
        refused = []
        start = 0
        for i, row in enumerate(batch.rows):
            fed, start = ids[start:start + row.count], start + row.count
            if self.refuse == (len(self.sent) - 1, i):
                refused.append(p.Refusal(row.stream, 1, "position", "scripted refusal"))
                continue
            if not row.want:
                continue
            rows = fed[-p.rows_read(row.want, row.count):]
            nexts = np.array([[NEXT(t) for t in rows]], np.int64)  # [1, R]
            if row.want.startswith("argmax"):
                out.append(p.Result(row.stream, batch.tick, p.Tensor.from_array(nexts), {}))
                continue
            k = p.parse_want(row.want)[1] or 1
            indices = np.stack([(nexts + j) % VOCAB for j in range(k)], axis=-1)  # [1, R, K]: the right id first
            values = np.broadcast_to(-np.arange(k, dtype=np.float32) * 10, indices.shape).copy()
            out.append(p.Result(row.stream, batch.tick, p.Tensor.from_array(values, "f32"), {},
                                p.Tensor.from_array(indices)))
        return [*out, p.BatchDone(batch.tick, {"stage0": 0.001}, refused)]


class ScriptedHost:
    """The head's side of a reconnect: a fresh ScriptedLink each time, retry windows that never expire."""

    def __init__(self) -> None:
        self.reconnects, self.replayed = 0, 0

    def reconnect(self, stale: ScriptedLink, deadline: float, cause: OvshardError) -> ScriptedLink:
        self.reconnects += 1
        return ScriptedLink(stale.blocks.num_blocks, stale.depth)

    def expired(self, deadline: float) -> bool:
        return False

    def count_replay(self, tokens: int) -> None:
        self.replayed += tokens


class OffByOne:
    """A drafter whose first ``right`` drafts are the model's next tokens and whose later ones are wrong."""

    name = "scripted"

    def __init__(self, right: int) -> None:
        self.right = right

    def fork(self) -> OffByOne:
        return self

    def draft(self, context: list[int], k: int, config: SamplingConfig, rng: object) -> tuple[list[int], None]:
        good = solo(context, k)
        return [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(good)], None


def engine_over(link: ScriptedLink, host: ScriptedHost | None = None, **config: int) -> Engine:
    settings = tick_budget(config.get("max_seqs", 8), max_chunk=config.get("max_chunk"))
    return Engine(host or ScriptedHost(), link, settings, MAX_POSITIONS, VOCAB, retry_s=30, timeout=30)


def run(engine: Engine, prompt: list[int], n: int, speculation: Speculation | None = None,
        config: SamplingConfig | None = None, index: list[int] = [0]) -> Request:  # noqa: B006  a counter
    index[0] += 1
    request = Request(index[0], prompt, config or SamplingConfig(max_tokens=n))
    engine.submit(request, speculation)
    return request


def settle(engine: Engine, until: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not until():
        assert time.monotonic() < deadline, "the engine never got there"
        time.sleep(0.002)


