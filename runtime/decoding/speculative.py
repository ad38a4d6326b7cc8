"""Speculative decoding: drafters, the accept rules, and choosing K.

Drafters propose K tokens cheaply; the pipeline scores all of them in one traversal (decode.py).

* :class:`PromptLookup` (the default): the newest earlier occurrence of the context's last n tokens
  (n = 3, 2, 1) in the prompt plus generated text; its continuation is the draft. No model.
* :class:`DraftModel`: a one-stage bundle with the same tokenizer, run on the head node. It keeps its
  own KV cache and rewinds it by mask to the common prefix of what it fed and the accepted text.

Accept rules (:func:`accept`), row i of the scores being the target after the i-th fed token:

* greedy: keep drafts while each equals the target's argmax, then add the target's argmax at the
  first mismatch (or after the last draft). The output is token for token plain greedy decoding.
* sampling: draft d_i with draft probability q_i(d_i) is kept with probability min(1, p_i(d_i) /
  q_i(d_i)); at the first rejection the token is drawn from max(0, p_i - q_i) renormalised, and when
  every draft is kept one more is drawn from p_K. The output distribution equals plain sampling from
  p (Leviathan et al. 2023, Chen et al. 2023). For prompt lookup q_i is a point mass on d_i.

K: fixed, or :class:`AutoK`, which estimates the per-draft acceptance rate a and models the cost of a
step of n fed tokens as 1 + c * n one-token overheads (never measured: timings would make the output of
a compressed bundle depend on the machine's load), and picks the K that maximises expected tokens per
cost, (1 - a^(K+1)) / (1 - a) / (1 + c (K + 1) + K * draft cost).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ovshard.bundle.manifest import Manifest, read_manifest, verify_files
from ovshard.errors import OvshardError
from ovshard.runtime.engine.kv import CompactionPolicy, KVCache
from ovshard.runtime.engine.sampler import SamplingConfig, probabilities
from ovshard.runtime.engine.scores import Scores

DEFAULT_K = 4
MAX_AUTO_K = 10
# AutoK's model of a step of n fed tokens: 1 + STEP_TOKEN_COST * n (a decode step reads every weight once;
# each more token adds its compute, about a quarter of a one-token step on the 1B shape here)
STEP_TOKEN_COST = 0.25


class Drafter(Protocol):
    name: str

    def fork(self) -> Drafter:
        """A drafter for a new stream: shares what is read-only (a compiled model), not the state."""
        ...

    def draft(self, context: list[int], k: int, config: SamplingConfig,
              rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to k draft tokens continuing ``context``, and their draft distributions (None: point masses)."""
        ...


class PromptLookup:
    """n-gram lookup in the prompt plus generated text; an index of n-grams grows with the context."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> newest start that has a continuation
        self._indexed = 0  # starts below this (per size) are in the index
        self._context: list[int] = []

    def fork(self) -> PromptLookup:
        return PromptLookup(max(self.sizes), min(self.sizes))

    def draft(self, context: list[int], k: int, config: SamplingConfig,
              rng: np.random.Generator) -> tuple[list[int], None]:
        self._update(context)
        for n in self.sizes:
            if len(context) <= n:
                continue
            start = self._index.get(tuple(context[-n:]))
            if start is not None:
                return list(context[start + n:start + n + k]), None
        return [], None

    def _update(self, context: list[int]) -> None:
        if context[:len(self._context)] != self._context:  # not an extension: a new text, start over
            self._index, self._indexed = {}, 0
        self._context = list(context)
        top = max(self.sizes)
        for start in range(max(0, self._indexed - top), len(context)):
            for n in self.sizes:
                if start + n < len(context):  # at least one token follows the n-gram
                    self._index[tuple(context[start:start + n])] = start
        self._indexed = len(context)


class DraftModel:
    """A one-stage bundle that drafts autoregressively on the head node, with its own mask rewind."""

    name = "draft"

    def __init__(self, bundle: Path, target: Manifest, device: str = "CPU", config: dict | None = None,
                 policy: CompactionPolicy | None = None) -> None:
        from ovshard.runtime.engine.stage import Stage  # openvino; only when a draft model is used

        self.bundle = Path(bundle)
        manifest = read_manifest(self.bundle)
        if manifest.num_stages != 1:
            raise OvshardError(f"draft bundle {bundle} has {manifest.num_stages} stages; a draft model must be "
                               "compiled with --stages 1")
        check_same_tokenizer(manifest, target, self.bundle)
        verify_files(self.bundle, manifest)
        self.stage = Stage(self.bundle, manifest, 0, device=device, config=config)
        self.policy = policy or CompactionPolicy(limit=self.stage.max_positions)
        self.fed: list[int] = []  # the tokens whose KV is visible in the draft cache, in order
        self.name = f"draft:{self.bundle}"

    def fork(self) -> DraftModel:
        """Same compiled draft model, a new InferRequest and an empty draft cache."""
        twin = copy.copy(self)
        twin.stage = copy.copy(self.stage)
        twin.stage.cache = KVCache(self.stage.compiled.create_infer_request())
        twin.fed = []
        return twin

    def draft(self, context: list[int], k: int, config: SamplingConfig,
              rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        common = 0
        for a, b in zip(self.fed, context, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # the last context token is fed again for its logits
        rewind = len(self.fed) - common
        cache = self.stage.cache
        compact = self.policy.wants(cache, len(context) - common)
        logits = self.stage.step(np.array([context[common:]], dtype=np.int64), common, rewind=rewind,
                                 compact=compact)[0, -1]
        self.fed = list(context)
        drafts: list[int] = []
        dists: list[np.ndarray] = []
        for i in range(k):
            if config.greedy:
                token = int(np.argmax(logits))
            else:
                q = probabilities(logits, config)
                dists.append(q)
                token = draw(q, rng)
            drafts.append(token)
            if i + 1 < k:
                logits = self.stage.step(np.array([[token]], dtype=np.int64), len(self.fed))[0, -1]
                self.fed.append(token)
        return drafts, (None if config.greedy else dists)


def check_same_tokenizer(draft: Manifest, target: Manifest, where: Path) -> None:
    """A draft model must share the target's token ids: same vocabulary, same tokenizer files."""
    dv, tv = draft.architecture.vocab_size, target.architecture.vocab_size
    if dv != tv:
        raise OvshardError(f"draft bundle {where} has a vocabulary of {dv} tokens, the target {tv}: a draft "
                           "model must use the target's tokenizer")
    ds = draft.tokenizer.sha256.get("openvino_tokenizer.bin") if draft.tokenizer else None
    ts = target.tokenizer.sha256.get("openvino_tokenizer.bin") if target.tokenizer else None
    if ds and ts and ds != ts:
        raise OvshardError(f"draft bundle {where} has a different tokenizer from the target's: a draft model "
                           "must use the target's tokenizer")


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a distribution over the vocabulary (inverse CDF with one uniform)."""
    cumulative = np.cumsum(p)
    i = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(i, int(np.flatnonzero(p)[-1]))


def accept(drafts: list[int], q: list[np.ndarray] | None, scores: Scores, config: SamplingConfig,
           rng: np.random.Generator, vocab: int) -> list[int]:
    """The kept drafts plus one token of the target's; see the module docstring for the rules."""
    last = scores.rows - 1
    if not drafts:
        return [scores.pick(last, config, rng)]
    first = scores.rows - len(drafts) - 1  # the row scoring the first draft
    out: list[int] = []
    for i, d in enumerate(drafts):
        row = first + i
        if config.greedy:
            target = scores.argmax(row)
            if target != d:
                return out + [target]
            out.append(d)
            continue
        p = scores.probabilities(row, config, vocab)
        qd = 1.0 if q is None else float(q[i][d])
        if rng.random() < min(1.0, p[d] / qd):
            out.append(d)
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        return out + [draw(residual, rng)]
    return out + [scores.pick(last, config, rng)]


@dataclass
class AutoK:
    """K from the observed acceptance rate and a modelled step cost: never from timings.

    A step of n fed tokens is modelled as costing ``1 + token_cost * n`` one-token overheads and a draft
    token ``draft_cost`` (a draft model: its weight bytes over the target's; prompt lookup: 0). Measured
    timings would make K, so the shapes of the verify steps, so the numerics of a compressed bundle, depend
    on the machine's load: the same prompt could decode differently from run to run. With K a function of
    the accepted tokens alone, a greedy run is the same every time.
    """

    k_max: int = MAX_AUTO_K
    start: int = DEFAULT_K
    decay: float = 0.95  # weight of older acceptance evidence per step
    kept: float = 1.0  # pseudo-counts: a prior acceptance of 1/2
    tried: float = 2.0
    token_cost: float = STEP_TOKEN_COST
    draft_cost: float = 0.0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.kept / self.tried

    def fresh(self) -> AutoK:
        """The same model for a new stream, with no acceptance evidence yet."""
        return AutoK(self.k_max, self.start, token_cost=self.token_cost, draft_cost=self.draft_cost)

    def choose(self) -> int:
        if self.steps < 2:
            return self.start
        a = min(self.acceptance, 0.999)

        def rate(k: int) -> float:
            tokens = (1 - a ** (k + 1)) / (1 - a)
            return tokens / (1.0 + self.token_cost * (k + 1) + k * self.draft_cost)

        return max(range(1, self.k_max + 1), key=rate)

    def observe(self, drafted: int, accepted: int, step_s: float, fed: int, draft_s: float) -> None:
        """Count the step's acceptance; its timings are not read (see the class docstring)."""
        self.steps += 1
        if drafted:
            self.kept = self.decay * self.kept + accepted
            self.tried = self.decay * self.tried + accepted + (1 if accepted < drafted else 0)


@dataclass
class Speculation:
    """One stream's speculative setup: its drafter, how K is chosen, and when caches compact."""

    drafter: Drafter
    k: int | AutoK
    policy: CompactionPolicy

    @property
    def name(self) -> str:
        return f"{self.drafter.name}, K={'auto' if isinstance(self.k, AutoK) else self.k}"

    def fresh(self) -> Speculation:
        """The same setup for a new stream: its own drafter state and K statistics."""
        k = self.k.fresh() if isinstance(self.k, AutoK) else self.k
        return Speculation(self.drafter.fork(), k, self.policy)

    def choose_k(self) -> int:
        return self.k.choose() if isinstance(self.k, AutoK) else self.k

    def observe(self, drafted: int, accepted: int, step_s: float, fed: int, draft_s: float = 0.0) -> None:
        if isinstance(self.k, AutoK):
            self.k.observe(drafted, accepted, step_s, fed, draft_s)


def _weight_bytes(bundle: Path) -> int:
    """Bytes of a bundle's stage weight files: what a decode step reads."""
    return sum((bundle / e.model_bin).stat().st_size for e in read_manifest(bundle).stages)


def parse_k(text: str | int) -> int | None:
    """--draft-k: an integer 1..64, or "auto" (None)."""
    if str(text) == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if not 1 <= k <= 64:
        raise OvshardError(f"--draft-k {text!r}: expected an integer from 1 to 64, or auto")
    return k


def make_speculation(spec: str, k: str | int, target: Manifest, *, device: str = "CPU",
                     config: dict | None = None, policy: CompactionPolicy | None = None,
                     target_path: Path | None = None) -> Speculation | None:
    """From --speculative (off | prompt-lookup | draft:PATH) and --draft-k (N | auto); None for off."""
    policy = policy or CompactionPolicy(limit=target.runtime_hints.max_positions)
    fixed = parse_k(k)
    k_policy: int | AutoK = fixed if fixed is not None else AutoK()
    if spec == "off":
        return None
    if spec == "prompt-lookup":
        return Speculation(PromptLookup(), k_policy, policy)
    if spec.startswith("draft:") and spec[6:]:
        path = Path(spec[6:])
        if not (path / "manifest.json").is_file():
            raise OvshardError(f"--speculative {spec}: {path} is not a bundle (no manifest.json); compile the "
                               "draft model with `ovshard compile DRAFT_CHECKPOINT --stages 1 -o PATH`")
        if isinstance(k_policy, AutoK):  # a draft token costs the draft's weight bytes over the target's
            k_policy = AutoK(draft_cost=_weight_bytes(path) / max(_weight_bytes(target_path), 1)) if target_path \
                else k_policy
        return Speculation(DraftModel(path, target, device, config), k_policy, policy)
    raise OvshardError(f"--speculative {spec!r}: expected off, prompt-lookup or draft:PATH_TO_ONE_STAGE_BUNDLE")

