"""``ovshard verify --perplexity TEXT``: a bundle's perplexity against its reference, scored as llama.cpp does.

The protocol of llama.cpp's ``llama-perplexity``, so figures compare with its published ones: the whole
text is tokenized once (by the reference's tokenizer, with its BOS), cut into chunks of ``context``
tokens (512), each chunk evaluated from an empty cache with its first token replaced by BOS, and only
the second half of each chunk scored (each scored token sees at least ``context / 2`` tokens before it).
The bundle and the reference score the same chunks, so their perplexities and their teacher-forced
top-1 tokens compare position by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovshard.errors import ConfigError

DEFAULT_CONTEXT = 512


@dataclass(frozen=True)
class Scores:
    """Negative log-likelihoods and top-1 tokens at every scored position, in chunk order."""

    nll: np.ndarray  # [scored positions], float64
    top1: np.ndarray  # [scored positions], the argmax at the position before each scored token

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


def chunks(ids: list[int], context: int, bos: int | None) -> list[list[int]]:
    """The text's full chunks of ``context`` tokens, each starting with BOS when the model has one."""
    if context < 4:
        raise ConfigError(f"--perplexity-context {context}: expected at least 4 tokens (llama.cpp uses 512)")
    count = len(ids) // context
    if count == 0:
        raise ConfigError(f"the perplexity text has {len(ids)} tokens, fewer than one chunk of {context}: "
                          f"give a longer text (about 2,000 tokens is typical) or a smaller --perplexity-context")
    out = []
    for k in range(count):
        chunk = list(ids[k * context:(k + 1) * context])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def score(logits_of: Callable[[list[int]], np.ndarray], text_chunks: list[list[int]]) -> Scores:
    """Score the second half of each chunk; ``logits_of(chunk)`` returns [len(chunk), vocab] from an empty cache."""
    nll, top1 = [], []
    for chunk in text_chunks:
        first = len(chunk) // 2
        part = predictions(np.asarray(logits_of(chunk))[first:-1], chunk[first + 1:])  # predicts chunk[first + 1:]
        nll.append(part.nll)
        top1.append(part.top1)
    return Scores(np.concatenate(nll), np.concatenate(top1))


def predictions(logits: np.ndarray, targets: list[int]) -> Scores:
    """Each row of ``logits`` [n, vocab] scored against the token it predicts (``targets``, n of them)."""
    x = logits.astype(np.float64)
    top = x.max(axis=1)
    log_z = np.log(np.exp(x - top[:, None]).sum(axis=1)) + top
    return Scores(log_z - x[np.arange(len(x)), np.asarray(targets)], x.argmax(axis=1))


def read_text(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--perplexity {path}: no such file; give a UTF-8 text file to score") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--perplexity {path}: not UTF-8 ({e.reason} at byte {e.start}); "
                          "give a UTF-8 text file") from None
    if not text.strip():
        raise ConfigError(f"--perplexity {path}: the file is empty; give a text of about 2,000 tokens")
    return text
