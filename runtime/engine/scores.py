"""What the last stage answers for the rows a step asked for, and how the head samples from it.

Both the decode loop (decode.py) and the accept rules (speculative.py) read a :class:`Scores`; the
worker builds one from its logits (``Scores.from_logits``, the reference for what goes on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ovshard.runtime.engine.sampler import SamplingConfig, probabilities, sample, sample_from_topk
from ovshard.runtime.wire.protocol import parse_want


@dataclass(frozen=True)
class Scores:
    """The last stage's answer for the last R rows: argmax ids [R], top-k values and ids [R, K], or
    logits [R, V]. Row i scores the token after the i-th of those R fed tokens."""

    values: np.ndarray
    indices: np.ndarray | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_logits(cls, logits: np.ndarray, want: str, timings: dict[str, float] | None = None) -> Scores:
        """What a last stage sends for ``want``, from its logits [T, V] (the reference for the wire)."""
        mode, k, rows = parse_want(want)
        if mode == "argmax":
            ids = logits.argmax(-1).astype(np.int64)
            return cls(ids[-rows:] if rows else ids, None, timings or {})
        last = logits[-(rows or 1):]
        if mode == "topk":
            idx = np.argsort(-last, axis=-1, kind="stable")[:, :k]
            return cls(np.take_along_axis(last, idx, -1), idx.astype(np.int64), timings or {})
        return cls(last, None, timings or {})

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])

    def argmax(self, row: int) -> int:
        values = self.values[row]
        if values.ndim == 0:
            return int(values)
        if self.indices is not None:  # top-k entries: the largest value, lowest id among ties
            ids = self.indices[row]
            return int(ids[np.lexsort((ids, -values))[0]])
        return int(np.argmax(values))

    def pick(self, row: int, config: SamplingConfig, rng: np.random.Generator) -> int:
        """Plain sampling from one row (what a step without drafts does)."""
        if config.greedy:
            return self.argmax(row)
        if self.indices is not None:
            return sample_from_topk(self.values[row], self.indices[row], config, rng)
        return sample(self.values[row].astype(np.float64), config, rng)

    def probabilities(self, row: int, config: SamplingConfig, vocab: int) -> np.ndarray:
        """The target distribution p of one row over the whole vocabulary (float64, sums to 1)."""
        if self.indices is None:
            return probabilities(self.values[row], config)
        local = probabilities(self.values[row], config)  # over the K entries, in their order
        p = np.zeros(vocab)
        p[self.indices[row]] = local
        return p
