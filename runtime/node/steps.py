"""The checks a stage runs on each Step before computing it, and what the last stage answers: pure
functions of the message, the stream's cache bookkeeping and the bundle's dimensions."""

from __future__ import annotations

import numpy as np

from ovshard.bundle.dims import ModelDims
from ovshard.runtime.engine.kv import KVCache
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.node.heads import RequestError
from ovshard.runtime.wire import protocol as p


def step_input(msg: p.Step, stage: int, dims: ModelDims) -> np.ndarray:
    """The Step's tensor as ``stage``'s input (ids [1, T] at stage 0, hidden states [1, T, H] after it),
    checked against the bundle's dimensions."""
    t = msg.tensor
    if stage == 0:
        if t.dtype not in ("i64", "i32") or len(t.shape) != 2:
            raise RequestError("failed", f"stage 0 takes token ids i64 [1, T], found {t.dtype}{list(t.shape)}")
        ids = t.to_array(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= dims.vocab_size):
            raise RequestError("failed", f"token ids must be in [0, {dims.vocab_size}), found "
                                         f"{int(ids.min())}..{int(ids.max())}")
        return ids
    if t.dtype not in ("f16", "f32") or len(t.shape) != 3 or t.shape[2] != dims.hidden_size:
        raise RequestError("failed", f"stage {stage} takes hidden states [1, T, {dims.hidden_size}] "
                                     f"(f16 or f32), found {t.dtype}{list(t.shape)}")
    return t.to_array(np.float32)


def check_step(msg: p.Step, tokens: int, cache: KVCache, stage: int, max_positions: int) -> None:
    """Refuse a Step of ``tokens`` tokens that does not fit the stream's cache or the bundle's positions."""
    if len(msg.timings) > stage:
        raise RequestError("failed", f"Step of stream {msg.stream}: {len(msg.timings)} timings, but only "
                                     f"{stage} stages come before stage {stage}")
    if msg.rewind > cache.visible:
        raise RequestError("position", f"Step of stream {msg.stream}: rewind {msg.rewind} but the cache holds "
                                       f"{cache.visible} visible positions")
    if msg.position != cache.visible - msg.rewind:
        raise RequestError("position", f"Step of stream {msg.stream}: position {msg.position}, but after the "
                                       f"rewind this stage holds {cache.visible - msg.rewind} visible positions")
    if msg.position + tokens > max_positions:
        raise RequestError("position", f"positions up to {msg.position + tokens - 1} asked; the bundle's "
                                       f"rotary table has {max_positions} (compile with a larger --max-positions)")
    physical = msg.position if msg.compact else cache.physical  # the cache's length once the step is in
    if physical + tokens > max_positions:
        raise RequestError("position", f"Step of stream {msg.stream}: the cache holds {cache.physical} positions "
                                       f"({cache.holes} hidden); {tokens} more pass the bundle's "
                                       f"{max_positions}: send compact=true")


def answer(msg: p.Step, logits: np.ndarray, timings: dict[str, float]) -> p.Result:
    """What the head's sampler needs from the last stage's logits [1, T, V], and no more: argmax ids,
    top-k, or rows of logits."""
    scores = Scores.from_logits(logits[0], msg.want)
    indices = None if scores.indices is None else p.Tensor.from_array(scores.indices[None])
    values = scores.values[None]
    return p.Result(msg.stream, msg.step, p.Tensor.from_array(values, None if values.dtype == np.int64 else "f32"),
                    timings, indices)
