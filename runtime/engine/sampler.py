"""Choosing the next token from the last stage's logits, deciding when to stop, and streaming text.

Everything here is a pure function of its arguments (plus an explicit numpy Generator), so the head
can sample the same way whether the last stage sent the full logits row or only its top-K entries.

The filters follow Hugging Face `generate` (temperature, then top-k, then top-p on the distribution
that top-k left), with one deterministic tie rule everywhere: among equal logits the lower token id
ranks first (it wins greedy, and it is kept by top-k when only some of the tied tokens fit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens and when to stop. A config that exists is valid (checked on construction)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.eos_token_ids, tuple):  # generation_config.json may give an int or a list
            ids = self.eos_token_ids
            object.__setattr__(self, "eos_token_ids", (ids,) if isinstance(ids, int) else tuple(ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range and its allowed range."""
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be token ids >= 0, got {self.eos_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_rng(config: SamplingConfig) -> np.random.Generator:
    """The generator one stream draws from: seeded runs repeat exactly, seed=None draws fresh entropy."""
    return np.random.default_rng(config.seed)


def _check_logits(logits: np.ndarray) -> np.ndarray:
    row = np.asarray(logits, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected one non-empty logits row [vocab], got shape {row.shape}")
    top = row.max()  # one pass: NaN anywhere makes it NaN, +inf anywhere +inf, every entry -inf -inf
    if np.isnan(top) or np.isposinf(top):
        raise ValueError("logits contain NaN or +inf: the last stage overflowed (try f32 inference hints)")
    if np.isneginf(top):
        raise ValueError("every logit is -inf: no token can be sampled")
    return row


def _rank(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Positions of `logits` from most to least likely; equal logits: lower token id first."""
    return np.lexsort((ids, -logits))


def _id(ids: np.ndarray | None, at: np.ndarray) -> np.ndarray:
    """The token ids at positions ``at`` (``ids`` None: a whole row, whose positions are its ids; no [vocab]
    range is made for it)."""
    return at if ids is None else ids[at]


def _best(logits: np.ndarray, ids: np.ndarray | None, k: int) -> np.ndarray:
    """`_rank(logits, ids)[:k]` without sorting the whole row: the k-th largest logit t splits it, every
    position above t is in, and positions equal to t fill the rest, lower ids first; only those k are sorted
    (a full sort of a 49,152-token row cost 5 ms a step)."""
    if k >= logits.size:
        return _rank(logits, _id(ids, np.arange(logits.size)))
    t = np.partition(logits, logits.size - k)[logits.size - k]  # the k-th largest
    above = np.flatnonzero(logits > t)
    tied = np.flatnonzero(logits == t)
    tied = tied[np.argsort(_id(ids, tied), kind="stable")[: k - above.size]]
    chosen = np.concatenate([above, tied])
    return chosen[_rank(logits[chosen], _id(ids, chosen))]


def _nucleus(logits: np.ndarray, z: Callable[[np.ndarray | None], np.ndarray], ids: np.ndarray | None,
             kept: np.ndarray | None, top_p: float) -> np.ndarray:
    """The top-p prefix (see `_support`) of the tokens kept so far (``kept``, ranked; None: the whole row),
    ranking only as many tokens as it takes (by their logits: z can round distinct logits together): 64, then
    8x more until their mass reaches ``top_p``, the whole pool at once past a quarter of it (a flat row)."""
    pool = logits.size if kept is None else kept.size
    total = np.exp(z(kept)).sum()
    m = min(64, pool)
    while True:
        order = kept[:m] if kept is not None else _best(logits, ids, m)
        cumulative = np.cumsum(np.exp(z(order)) / total)
        n = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        if n <= m or m == pool:
            return order[: min(n, order.size)]
        m = pool if 8 * m >= pool // 4 else 8 * m


def _support(logits: np.ndarray, ids: np.ndarray | None,
             config: SamplingConfig) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens that survive the filters and their probabilities, ordered by token id (``ids`` None: the
    row's positions are the ids, and with no filter the probabilities come back for the whole row, ids None).

    With z = (l - max l) / T (the shift leaves softmax unchanged and keeps every exponent <= 0, so huge
    logits cannot overflow and -inf entries get probability 0):
      top-k: keep the k largest z (ties: lower id first), i.e. exactly min(k, vocab) tokens;
      top-p: with q = softmax over the kept z sorted descending, keep the first n tokens where n is the
             smallest count with q_1 + ... + q_n >= p (n >= 1 always; the token that crosses p stays);
      p_i = exp(z_i) / sum_kept exp(z_j) over what is left, 0 elsewhere.
    Greedy (T = 0) is the limit T -> 0: all mass on the argmax (lowest id among ties).
    Only the tokens a filter keeps are ranked; with no filter nothing is.
    """
    if config.greedy:
        return _id(ids, _best(logits, ids, 1)), np.ones(1)
    top, temperature = logits.max(), config.temperature

    def z(at: np.ndarray | None) -> np.ndarray:
        """z of the positions ``at`` (None: the whole row), each the same number the whole row's would hold:
        a top-k filter needs only its k."""
        with np.errstate(over="ignore"):  # a logit far below the max may overflow to -inf: probability 0
            return ((logits if at is None else logits[at]) - top) / temperature

    order = _best(logits, ids, config.top_k) if config.top_k else None
    if config.top_p < 1:
        order = _nucleus(logits, z, ids, order, config.top_p)
    if order is None:
        if ids is None:  # the whole row, in id order already
            p = np.exp(z(None))
            return None, p / p.sum()
        order = np.arange(ids.size)
    order = order[np.argsort(_id(ids, order), kind="stable")]  # by token id, so both sample paths draw alike
    p = np.exp(z(order))
    return _id(ids, order), p / p.sum()


def probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The distribution `sample` draws from, float64 [vocab], summing to 1 (see `_support` for the math)."""
    row = _check_logits(logits)
    ids, p = _support(row, None, config)
    if ids is None:
        return p
    out = np.zeros(row.size)
    out[ids] = p
    return out


def _draw(ids: np.ndarray | None, p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse CDF over tokens in id order with one uniform u: token i iff c_{i-1} <= u * c_n < c_i
    (``ids`` None: p covers the whole row, position = id)."""
    cumulative = np.cumsum(p)
    pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    if pick == p.size:  # rounding put u * c_n on c_n itself: the last token with mass (elsewhere p[pick] > 0)
        pick = int(np.flatnonzero(p)[-1])
    return pick if ids is None else int(ids[pick])


def sample(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator) -> int:
    """The next token: argmax when greedy (rng untouched), else one draw from `probabilities`."""
    row = _check_logits(logits)
    if config.greedy:
        return int(np.argmax(row))  # numpy's argmax returns the first (lowest) index among ties
    return _draw(*_support(row, None, config), rng)


def sample_from_topk(values: np.ndarray, indices: np.ndarray, config: SamplingConfig,
                     rng: np.random.Generator) -> int:
    """`sample` on the full row, computed from its top-K entries only (K >= config.top_k, any order).

    Top-k keeps only tokens from the K largest logits, and softmax over the kept set needs no other
    logit, so this is the same distribution; with the same rng state it returns the same token.
    """
    row = _check_logits(values)
    ids = np.asarray(indices)
    if ids.shape != row.shape or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"expected integer token ids shaped like the values {row.shape}, got "
                         f"{ids.dtype} {ids.shape}")
    if config.greedy:
        return int(ids[_rank(row, ids)[0]])
    return _draw(*_support(row, ids, config), rng)


def should_stop(tokens: Sequence[int], config: SamplingConfig) -> bool:
    """True once the last generated token is an eos id or `max_tokens` tokens have been generated.

    `tokens` are the generated tokens only, not the prompt.
    """
    return len(tokens) > 0 and (int(tokens[-1]) in config.eos_token_ids or len(tokens) >= config.max_tokens)


