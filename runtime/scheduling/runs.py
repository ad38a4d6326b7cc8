"""A request's decode state inside the engine, and the accept step for every answered row of a tick.

Per request (:class:`Run`): its history (prompt + tokens delivered), the drafts of its next row, its sampler
(a seeded generator) and its speculation. The engine calls :meth:`Run.propose` before a row is planned and
:meth:`Run.take` with what the accept rule kept of an answered row; ``take`` delivers the tokens, stops at an
eos id, max_tokens or a full context, and gives the planner its ``Sampled`` straight from the accept result::

    Sampled(token = the target's token after the kept drafts, accepted = drafts kept, drafts = next proposals)

:func:`accept_rows` is the accept rule over every row of a tick at once. Greedy rows (the last stage sent
argmax ids t_0..t_K for drafts d_0..d_{K-1}) in one numpy pass:

    kept = min{i : d_i != t_i} (K when every draft matched);   new tokens = d_0..d_{kept-1}, t_kept

Sampled rows (top-k or logits) go through speculative.accept one by one (the rule in speculative.py).
"""

from __future__ import annotations

import time

import numpy as np

from ovshard.runtime.decoding.decode import want_for
from ovshard.runtime.decoding.speculative import Speculation, accept
from ovshard.runtime.engine.sampler import make_rng, should_stop
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.scheduling.plan_types import Sampled
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.scheduling.ticks import MAX_DRAFTS


class Run:
    """One request's decode state (the module docstring)."""

    def __init__(self, request: Request, speculation: Speculation | None, max_positions: int) -> None:
        self.request, self.max_positions = request, max_positions
        self.config = request.config
        self.speculation = speculation.fresh() if speculation else None
        self.rng = make_rng(self.config)
        self.history = list(request.prompt)  # the prompt, then every token delivered
        self.drafts: list[int] = []
        self.q: list[np.ndarray] | None = None  # the drafts' distributions (None: point masses)
        self.seq = -1  # its sequence at the planner now (a new one after each replay)
        self.parked: Sampled | None = None  # a paced request's answer, held until its reader asks for more
        self.deadline: float | None = None  # end of its retry window, from its first failure since an answer
        self.start = self.step_start = time.perf_counter()
        request.stats.prompt_tokens = len(request.prompt)
        if self.speculation:
            request.stats.speculative = self.speculation.name

    @property
    def emitted(self) -> int:
        return len(self.history) - len(self.request.prompt)

    def prompt_error(self) -> str:
        """Why the prompt cannot run ("" when it can)."""
        if len(self.request.prompt) > self.max_positions:
            return (f"the prompt has {len(self.request.prompt)} tokens; this bundle serves at most "
                    f"{self.max_positions} positions (compile with a larger --max-positions)")
        return "" if self.request.prompt else "a prompt needs at least one token id, got none"

    def propose(self) -> None:
        """The drafts of its next row (none without speculation, or with no room for them)."""
        room = min(self.config.max_tokens - self.emitted - 1, self.max_positions - len(self.history))
        self.drafts, self.q = [], None
        if self.speculation and room > 0:
            t0 = time.perf_counter()
            k = min(self.speculation.choose_k(), room, MAX_DRAFTS)
            self.drafts, self.q = self.speculation.drafter.draft(self.history, k, self.config, self.rng)
            self.request.stats.draft_s += time.perf_counter() - t0 if self.emitted else 0.0
            self.request.stats.k_chosen.append(k)

    @property
    def ids(self) -> list[int]:
        """What its sequence holds: the history, then the drafts to verify."""
        return self.history + self.drafts

    def want(self, rows: int) -> str:
        return want_for(self.config, rows)

    def take(self, new: list[int], verified: int, timings: dict[str, float]) -> Sampled:
        """Deliver the tokens the accept rule kept of a row that verified ``verified`` drafts; the Sampled for
        the planner (``finished`` when the request stopped)."""
        stats, now = self.request.stats, time.perf_counter()
        elapsed, kept = now - self.step_start, len(new) - 1
        stats.step_s.append(elapsed)
        stats.stage_s.append(dict(timings))
        stats.drafted += verified
        stats.accepted += kept
        if verified > kept:  # the rejected drafts' positions are taken back (the planner shortens the table)
            stats.rewinds += 1
            stats.rewound_positions += verified - kept
        if self.speculation:
            self.speculation.observe(verified, kept, elapsed, verified + 1, 0.0)
        if not self.emitted:
            stats.first_token_s = now - self.start
        self.deadline = None
        produced = 0
        for token in new:
            self.history.append(token)
            produced += 1
            self.request.deliver(token)
            if should_stop(self.history[len(self.request.prompt):], self.config):
                stats.step_tokens.append(produced)
                stats.finish_reason = "stop" if token in self.config.eos_token_ids else "length"
                return Sampled(new[-1], kept, (), finished=True)
        stats.step_tokens.append(produced)
        if len(self.history) > self.max_positions:  # every position holds a fed token: the context is full
            stats.finish_reason = "length"
            return Sampled(new[-1], kept, (), finished=True)
        self.propose()
        self.step_start = time.perf_counter()
        return Sampled(new[-1], kept, tuple(self.drafts))


def accept_rows(runs: list[Run], verified: list[int], scores: list[Scores], vocab: int) -> list[list[int]]:
    """The accept rule for every answered row of a tick (the module docstring): the new tokens of each run,
    whose row verified its first ``verified[i]`` drafts."""
    out: list[list[int]] = [[] for _ in runs]
    greedy = [i for i, (run, s) in enumerate(zip(runs, scores, strict=True))
              if run.config.greedy and s.indices is None and s.values.ndim == 1]
    if greedy and not any(verified[i] for i in greedy):  # no drafts: each row's one argmax id
        for i in greedy:
            out[i] = [int(scores[i].values[-1])]
    elif greedy:
        k = max(verified[i] for i in greedy)
        drafted = np.full((len(greedy), k), -1, np.int64)  # [rows, K]: each row's drafts, -1 past them
        target = np.full((len(greedy), k + 1), -2, np.int64)  # [rows, K + 1]: the argmax ids, -2 past them
        for r, i in enumerate(greedy):
            n = verified[i]
            drafted[r, :n] = runs[i].drafts[:n]
            target[r, :n + 1] = scores[i].values[-(n + 1):]
        match = drafted == target[:, :k]
        kept = np.where(match.all(axis=1), k, np.argmin(match, axis=1)) if k else np.zeros(len(greedy), np.int64)
        for r, i in enumerate(greedy):
            out[i] = [*runs[i].drafts[:kept[r]], int(target[r, kept[r]])]
    for i, (run, s) in enumerate(zip(runs, scores, strict=True)):
        if not out[i]:
            q = None if run.q is None else run.q[:verified[i]]
            out[i] = accept(run.drafts[:verified[i]], q, s, run.config, run.rng, vocab)
    return out
