"""The calibrated INT4 scale fit: a weight's groups fitted to their calibration inputs, many rows at once (torch, f32).

A weight ``W`` [out, in] is stored as symmetric INT4 codes ``q`` in [-8, 7], ``group`` inputs to a scale
``s`` (one f16 a row and group), and read back as ``s * q``. Its output on calibration inputs ``X`` [tokens,
in] errs by ``||(W - s q) X^T||^2``; with the error of each group counted on its own inputs alone (the cross
terms between groups left out, as NNCF's scale estimation does), a row's group with weights ``w``, error
``d = w - s q`` and the group's input second moments ``H = X_g^T X_g / tokens`` [group, group] errs by
``d^T H d``. For each group the fit starts from the min-max scale, signed so that the weight of largest
magnitude maps to -8 (NNCF's symmetric INT4), and alternates: the least-squares scale of the codes,
``s = q^T H w / q^T H q`` (the best scale for those codes), then the codes that scale rounds to (the nearest
ones), ``ROUNDS`` times; of the scales and codes met on the way it keeps the pair of least error. It tries
no grid of shrunk min-max scales: clipping the largest weights of a group that way fitted the calibration
text and lost on other text (SmolLM2-135M, docs/results/2026-12-int4-fit.md).

Every candidate is evaluated after rounding its scale to f16, as stored, so the error compared is the stored
weight's. All of it is matmuls (through oneDNN: ``ovshard.frontend.onednn``), dot products a row and elementwise
ops over a tile of one group's rows at a time (``BLOCK_BYTES``), whose moments [g, g] stay in cache for all its
rows; memory stays a few tiles of a weight. Each (row, group) is fitted on its own, so the bytes are the same at
any thread count.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from ovshard.frontend.onednn import linear
from ovshard.memory import heap_below

ROUNDS = 1  # least-squares refits after the first (each: the codes its scale rounds to, and their own refit)
LOW, HIGH = -8, 7  # symmetric INT4 codes
BLOCK_BYTES = 2 << 20  # the tile fitted at once holds about this much f32: few enough torch ops a weight that 16
# threads do not queue on the GIL between them, and the temporaries still in a core's L2; kept in the heap while the
# fit runs (ovshard.memory.heap_below), not mapped and zero-filled anew each


def second_moments(inputs: torch.Tensor, group: int) -> torch.Tensor:
    """Per group of ``group`` input channels, ``X_g^T X_g / tokens`` of ``inputs`` [tokens, in]: [groups, g, g]."""
    tokens, width = inputs.shape
    x = inputs.reshape(tokens, width // group, group).transpose(0, 1)  # [groups, tokens, group]
    return torch.bmm(x.transpose(1, 2), x) / tokens


def fit(weight: torch.Tensor, moments: torch.Tensor, workers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8 in [-8, 7], [out, groups, group]) and f16 scales ([out, groups, 1]) of ``weight`` [out, in]
    that minimise each group's ``d^T H d`` over the candidate scales; ``moments`` from :func:`second_moments`; on
    ``workers`` threads (torch's count if None), the same bytes on any number."""
    codes, scales = _fit_tiles(weight, moments, _fit_block, (torch.int8, torch.float16), workers)
    return codes, scales


def fit_asym(weight: torch.Tensor, moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric INT4 of ``weight`` [out, in] as :func:`fit` does symmetric: codes ``q`` in [0, 15] (uint8, [out,
    groups, group]), zero points ``z`` (uint8, [out, groups, 1]) and f16 scales, read back as ``s (q - z)``. From the
    min-max scale and its zero point, the same alternation over ``q - z``: the least-squares scale of the codes,
    then the codes and zero point that scale rounds to; the pair of least ``d^T H d`` is kept."""
    codes, zeros, scales = _fit_tiles(weight, moments, _fit_block_asym, (torch.uint8, torch.uint8, torch.float16))
    return codes, zeros, scales


def fit_inputs(inputs: torch.Tensor, weight: np.ndarray, group: int, moments: dict[tuple[int, int], torch.Tensor],
               workers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` fitted to ``inputs`` [tokens, in] (:func:`fit`); their second moments kept in ``moments`` for the
    weights that read the same inputs (q, k and v; gate and up)."""
    if (id(inputs), group) not in moments:
        moments[(id(inputs), group)] = second_moments(inputs, group)
    codes, scales = fit(read_only(weight), moments[(id(inputs), group)], workers)
    return codes.numpy(), scales.numpy()


def read_only(weight: np.ndarray) -> torch.Tensor:
    """``weight`` as a tensor on the same memory, no copy. The graph's constant lends it read-only; the fit and the
    min-max scale only read it, so torch's warning that writing to such a tensor is undefined is silenced here."""
    if weight.flags.writeable:
        return torch.from_numpy(weight)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(weight)


def _fit_tiles(weight: torch.Tensor, moments: torch.Tensor, fit_block: Callable[..., tuple[torch.Tensor, ...]],
               dtypes: tuple[torch.dtype, ...], workers: int | None = None) -> tuple[torch.Tensor, ...]:
    """``fit_block`` (:func:`_fit_block`, :func:`_fit_block_asym`) over ``weight`` [out, in] in tiles of one group's
    rows, spread over torch's threads; its outputs, the codes [rows, group] then the rest [rows, 1], gathered as
    [out, groups, group] and [out, groups, 1] of ``dtypes``."""
    out_features, width = weight.shape
    groups, group, _ = moments.shape
    if groups * group != width:
        raise ValueError(f"a weight of {width} inputs and moments of {groups} groups of {group}")
    outputs = [torch.empty(out_features, groups, group if n == 0 else 1, dtype=dtype) for n, dtype in enumerate(dtypes)]
    transposed = moments.transpose(1, 2).contiguous()  # the weight of a linear that multiplies by H: x H = x (H^T)^T
    rows = max(1, BLOCK_BYTES // (4 * group))

    def fit_tile(tile: tuple[int, int]) -> None:
        start, g = tile
        w = weight[start:start + rows, g * group:(g + 1) * group].float().contiguous()  # [rows, group]
        for out, part in zip(outputs, fit_block(w, transposed[g]), strict=True):
            out[start:start + rows, g] = part

    tiles = [(start, g) for start in range(0, out_features, rows) for g in range(groups)]
    workers = workers or torch.get_num_threads()
    # each worker one thread for oneDNN too: its OpenMP thread count is per thread, and a new one would take every core
    with torch.no_grad(), _one_thread(), heap_below(4 * BLOCK_BYTES), ThreadPoolExecutor(
            workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        list(pool.map(fit_tile, tiles))
    return tuple(outputs)


def _fit_block_asym(w: torch.Tensor, ht: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_fit_block` for asymmetric codes: the signed codes ``q - z`` take the place of ``q``."""
    low = w.amin(-1, keepdim=True)

    def rounded(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.div(-low, s).round_().clamp_(0, 15)
        return torch.div(w, s).round_().add_(z).clamp_(0, 15).sub_(z), z

    s = _f16((w.amax(-1, keepdim=True) - low) / 15)
    c, z = rounded(s)
    best_err = torch.full_like(low, float("inf"))
    best_s, best_base, best_z = s, s, z
    for step in range(ROUNDS + 1):
        chw, chc = _moments_of(c, w, ht)
        refit = _f16(torch.where((chc > 0) & (chw > 0), chw / chc, s))
        for cand in (s, refit):
            err = _error(cand, chw, chc)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, cand, best_s)
            best_base = torch.where(better, s, best_base)
            best_z = torch.where(better, z, best_z)
        if step < ROUNDS:
            s = refit
            c, z = rounded(s)
    q = torch.div(w, best_base).round_().add_(best_z).clamp_(0, 15)  # the chosen codes, at the scale they came from
    return q.to(torch.uint8), best_z.to(torch.uint8), best_s.to(torch.float16)


def minmax(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data-free codes and f16 scales of ``weight`` [out, in] (as :func:`fit` returns them): each group's signed
    min-max scale, the codes it rounds to (NNCF's symmetric INT4): for a weight with no calibration inputs, such
    as an expert no calibration token was routed to."""
    w = weight.float().reshape(weight.shape[0], -1, group)  # [out, groups, g]
    s = _f16(_minmax(w))
    return torch.div(w, s).round_().clamp_(LOW, HIGH).to(torch.int8), s.to(torch.float16)


def _minmax(w: torch.Tensor) -> torch.Tensor:
    """Each group's min-max scale over the last axis, signed: the weight of largest magnitude maps to -8."""
    high, low = w.amax(-1, keepdim=True), w.amin(-1, keepdim=True)
    return torch.where(-low >= high, -low, -high) / -LOW


def _fit_block(w: torch.Tensor, ht: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best codes and f16 scales of ``w`` [rows, g] for one group's moments, given transposed (``ht`` = H^T).

    For codes ``q`` and a scale ``s`` the error expands to ``w^T H w - 2 s q^T H w + s^2 q^T H q``. The first term
    is the same for every candidate of a row, so candidates are compared without it (:func:`_error`); each set of
    codes costs one matmul (``H q``) and two dot products a row (:func:`_moments_of`), and the scales tried for
    them (the one they were rounded at, their least-squares one) a few ops on [rows, 2]. Of all the pairs, in the
    order met, the first of least error is kept."""
    s = _f16(_minmax(w))
    codes, tried, errors = [torch.div(w, s).round_().clamp_(LOW, HIGH)], [], []
    for step in range(ROUNDS + 1):
        q = codes[step]
        qhw, qhq = _moments_of(q, w, ht)
        refit = _f16(torch.where(qhq > 0, qhw / qhq, s))  # the least-squares scale of these codes
        scales = torch.cat((s, refit), -1)  # [rows, 2]: the scales tried for these codes
        tried.append(scales)
        errors.append(_error(scales, qhw, qhq))
        if step < ROUNDS:
            s = refit
            codes.append(torch.div(w, s).round_().clamp_(LOW, HIGH))
    # the first of least error, as a running minimum keeps it; an error that is NaN never wins
    best = torch.cat(errors, -1).nan_to_num_(nan=float("inf")).argmin(-1, keepdim=True)  # [rows, 1]
    chosen = codes[-1]
    for step in range(ROUNDS - 1, -1, -1):
        chosen = torch.where(best < 2 * (step + 1), codes[step], chosen)
    return chosen.to(torch.int8), torch.cat(tried, -1).gather(-1, best).to(torch.float16)


def _moments_of(q: torch.Tensor, w: torch.Tensor, ht: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q^T H w`` and ``q^T H q`` of each row of codes ``q`` [rows, g] (float) and weights ``w``, [rows, 1] each:
    one matmul (``q H``) and two dot products a row, each one pass over its tile (a batched [1, g] x [g, 1]
    matmul; a product then a sum would write and read a whole tile between them)."""
    hq = linear(q, ht)  # [rows, g]: q H
    return _rowdot(w, hq), _rowdot(q, hq)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The dot product of each row of ``a`` and ``b`` [rows, g]: [rows, 1]."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0], 1)


def _error(scale: torch.Tensor, qhw: torch.Tensor, qhq: torch.Tensor) -> torch.Tensor:
    """``d^T H d - w^T H w`` of codes at ``scale`` (``-2 s q^T H w + s^2 q^T H q``, H symmetric): the error up to a
    row's constant, all that comparing the candidates of a row needs."""
    return scale * (scale * qhq - 2 * qhw)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch ops on one thread each, the blocks spread over torch's threads instead (:func:`fit`): each op here is
    a block's worth, too small to share, and OpenMP's barrier waiting on a thread the machine's other work had
    preempted made the fit 4-6x slower on 2 loaded cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _f16(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as stored: rounded to f16, a zero made the smallest normal f16 (a group of zeros keeps codes 0)."""
    tiny = torch.finfo(torch.float16).tiny
    s = scale.to(torch.float16).float()
    return torch.where(s.abs() < tiny, tiny, s)
