"""Which decoder weights keep INT8 in an INT4 bundle: chosen once for the whole model, from the weights alone.

Every decoder weight (q, k, v, o, gate, up, down of every layer) is quantized to INT4 as the compression
pass will (NNCF's grouped min/max quantizer: asymmetric or symmetric, the same group size and fallback),
and scored by its relative reconstruction error ``||W - Q(W)||^2 / ||W||^2``: how much of the weight
INT4 destroys. The weights with the largest error stay INT8 (per channel), most sensitive first, while
the bundle stays within ``budget`` times the size of the same model in all-INT4 asymmetric group-128
(ovshard's INT4 before, with the embedding and lm_head INT8, counted as a bundle of two or more stages
stores them: a tied embedding twice) and at least ``ratio`` of the decoder's weights stay INT4.

A mixture of experts is held by memory but read by what is routed: a decode step reads ``experts_per_token``
of a sparse layer's ``num_experts`` experts. So the budget also bounds what a token reads: the same model
with each sparse layer's routed experts counted at ``experts_per_token / num_experts`` of their bytes (the
dense model of the same active parameters) stays within ``budget`` of its all-INT4 size too. Without it the
budget, spent by memory, would keep INT8 everything a token reads whole (attention, a shared expert) beside
hundreds of experts, and an MoE stage would read a larger INT8 share a step than a dense stage of its active
parameters. In a dense model both bounds are the same sum, so its choice is the memory one.
Weights are read one layer at a time, so memory stays at one layer, and the choice depends on the
checkpoint and the format only: the same for every stage count (it is kept in the manifest's weight
format).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ovshard.bundle.dims import ModelDims
from ovshard.bundle.stage import StageSpec
from ovshard.bundle.weights import WeightFormat
from ovshard.frontend.tensors import linear_shapes

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

def int4_bytes(fmt: WeightFormat, out_features: int, in_features: int) -> float:
    """Stored bytes of one weight in ``fmt``'s INT4 (4-bit codes, an f16 scale and, asymmetric, a 4-bit zero
    point per group), or in INT8 (1-byte codes, an f16 scale and a zero point per channel) when it falls back."""
    group = fmt.group_for(in_features)
    if group is None:
        return int8_bytes(out_features, in_features)
    per_group = 2.0 + {"int4_asym": 0.5, "int4_affine": 2.0}.get(fmt.mode, 0.0)
    return out_features * (in_features * 0.5 + in_features / group * per_group)


def int8_bytes(out_features: int, in_features: int) -> float:
    return out_features * (in_features + 3.0)


def int4_error(weight: np.ndarray, fmt: WeightFormat) -> float:
    """Relative squared error of ``weight`` [out, in] after NNCF-style grouped INT4 and back (0 if it falls back)."""
    squared_error, squared = _int4_sums(weight, fmt)
    return float(squared_error / max(squared, 1e-30))


def stacked_int4_error(weights: np.ndarray, fmt: WeightFormat) -> float:
    """``int4_error`` of stacked matrices [n, out, in] (a layer's experts) taken as one, computed a matrix at a
    time: the quantizer's temporaries are one expert's, not a layer's experts' (for GLM-4.5-Air's 128 experts
    each of them would be 2.9 GB in float32)."""
    squared_error = squared = 0.0
    for weight in weights:
        e, w = _int4_sums(weight, fmt)
        squared_error, squared = squared_error + float(e), squared + w
    return squared_error / max(squared, 1e-30)


def _int4_sums(weight: np.ndarray, fmt: WeightFormat) -> tuple[np.floating | float, float]:
    """``||W - Q(W)||^2`` and ``||W||^2`` of ``weight`` [out, in] under NNCF-style grouped INT4 (0, 1 if it falls
    back)."""
    out_features, in_features = weight.shape
    group = fmt.group_for(in_features)
    if group is None:
        return 0.0, 1.0
    w = weight.astype(np.float32).reshape(out_features, in_features // group, group)
    if fmt.mode == "int4_affine":  # an f16 offset: the group's minimum exactly
        low, high = w.min(axis=-1, keepdims=True), w.max(axis=-1, keepdims=True)
        scale = np.maximum((high - low) / 15.0, np.finfo(np.float32).tiny)
        restored = np.round((w - low) / scale) * scale + low
    elif fmt.mode == "int4_asym":
        low, high = w.min(axis=-1, keepdims=True), w.max(axis=-1, keepdims=True)
        scale = np.maximum((high - low) / 15.0, np.finfo(np.float32).tiny)
        zero = np.clip(np.round(-low / scale), 0, 15)
        restored = (np.clip(np.round(w / scale) + zero, 0, 15) - zero) * scale
    else:
        scale = np.maximum(np.abs(w).max(axis=-1, keepdims=True) / 8.0, np.finfo(np.float32).tiny)
        restored = np.clip(np.round(w / scale), -8, 7) * scale
    return ((w - restored) ** 2).sum(), float((w**2).sum())


def embedding_bytes(dims: ModelDims, fmt: WeightFormat) -> float:
    """Stored bytes of one copy of the embedding table (or an lm_head of its shape) in ``fmt``: INT8 beside
    INT4 weights unless ``all_layers`` or an INT4 ``embedding`` format, else as the format stores any matrix."""
    if fmt.table is not None:
        return int4_bytes(fmt.table, dims.vocab_size, dims.hidden_size)
    if fmt.is_int4:
        return int4_bytes(fmt, dims.vocab_size, dims.hidden_size) if fmt.all_layers else \
            int8_bytes(dims.vocab_size, dims.hidden_size)
    if fmt.mode == "int8":
        return int8_bytes(dims.vocab_size, dims.hidden_size)
    return dims.vocab_size * dims.hidden_size * (4.0 if fmt.mode == "fp32" else 2.0)


def int4_groups(dims: ModelDims, fmt: WeightFormat) -> set[int]:
    """The group sizes of the grouped INT4 weights a bundle in ``fmt`` stores (per-channel INT4, INT8 and float
    weights have none): every decoder weight not kept INT8, NNCF's fallback group where the format's does not
    divide a weight's inputs, and the embedding and lm_head where they are INT4."""
    if not fmt.is_int4:
        return set()
    groups = set()
    if fmt.group_size > 0:  # -1: one scale per output channel, no groups
        kept = set(fmt.int8_weights)
        groups = {fmt.group_for(i) for layer in range(dims.num_layers)
                  for key, (_, i) in linear_shapes(dims, layer).items() if f"{layer}.{key}" not in kept}
    table = fmt.table or (fmt if fmt.all_layers else None)
    if table is not None and table.group_size > 0:
        groups.add(table.group_for(dims.hidden_size))
    return {g for g in groups if g is not None}


@dataclass(frozen=True)
class Candidate:
    """One decoder weight: its key (``"3.down"``), INT4 error, the bytes INT8 would add to the bundle and to
    what a decode step reads (``read_share`` of them)."""

    key: str
    error: float
    extra_bytes: float
    elements: int
    read_share: float = 1.0


BASE = WeightFormat("int4_asym", 128, ratio=1.0, budget=1.0)  # the all-INT4 asym format: the budget's unit


def all_int4_bytes(dims: ModelDims, fmt: WeightFormat = BASE, routed: bool = False) -> float:
    """Bytes of the model's matrices with every decoder weight in ``fmt``'s INT4 and the embedding and lm_head
    in INT8, as a bundle of two or more stages stores them (a tied embedding in the first and the last stage);
    ``routed``: each sparse layer's experts counted by the share a token routes to (:func:`read_share`)."""
    ends = 2 * embedding_bytes(dims, fmt)
    return ends + sum(int4_bytes(fmt, o, i) * (read_share(dims, layer, key) if routed else 1.0)
                      for layer in range(dims.num_layers) for key, (o, i) in linear_shapes(dims, layer).items())


def read_share(dims: ModelDims, layer: int, key: str) -> float:
    """The share of projection ``key`` of ``layer`` a decode step reads: a sparse layer's stacked experts
    ``experts_per_token / num_experts``, anything else 1."""
    if key.startswith("experts_") and dims.sparse(layer):
        return dims.experts_per_token / dims.num_experts
    return 1.0


def candidates(ckpt: Checkpoint, fmt: WeightFormat) -> list[Candidate]:
    """Every decoder weight scored, read one layer at a time."""
    from ovshard.frontend.trace import load_layer

    dims, found = ckpt.dims, []
    whole = StageSpec(0, 1, 0, dims.num_layers)
    for i in range(dims.num_layers):
        layer = load_layer(ckpt, i, whole)
        for key, (out_f, in_f) in linear_shapes(dims, i).items():
            if fmt.group_for(in_f) is None:
                continue  # NNCF stores it in INT8 anyway
            weight = getattr(layer, f"{key}_weight").numpy()
            error = (stacked_int4_error(weight.reshape(dims.num_experts, -1, in_f), fmt) if key.startswith("experts_")
                     else int4_error(weight.reshape(out_f, in_f), fmt))
            found.append(Candidate(f"{i}.{key}", error,
                                   int8_bytes(out_f, in_f) - int4_bytes(fmt, out_f, in_f), out_f * in_f,
                                   read_share(dims, i, key)))
        del layer
        log.debug("precision: layer %d of %d scored", i + 1, dims.num_layers)
    return found


def choose_int8(ckpt: Checkpoint, fmt: WeightFormat) -> tuple[str, ...]:
    """The decoder weights kept in INT8 for ``fmt`` (sorted keys); () when the format keeps none."""
    if not fmt.is_int4 or fmt.budget <= 1.0 or fmt.ratio >= 1.0:
        return ()
    scored = sorted(candidates(ckpt, fmt), key=lambda c: c.error, reverse=True)
    dims, unit = ckpt.dims, replace(BASE, all_layers=fmt.all_layers)
    # a smaller group size spends part of each budget: held (the bundle's bytes) and read (a decode step's)
    allowed = fmt.budget * all_int4_bytes(dims, unit) - all_int4_bytes(dims, fmt)
    allowed_read = fmt.budget * all_int4_bytes(dims, unit, routed=True) - all_int4_bytes(dims, fmt, routed=True)
    total = sum(c.elements for c in scored)
    max_int8 = math.floor((1.0 - fmt.ratio) * total)
    chosen, spent, spent_read, int8_elements = [], 0.0, 0.0, 0
    for c in scored:
        read = c.extra_bytes * c.read_share
        if (spent + c.extra_bytes <= allowed and spent_read + read <= allowed_read
                and int8_elements + c.elements <= max_int8):
            chosen.append(c.key)
            spent += c.extra_bytes
            spent_read += read
            int8_elements += c.elements
    log.info("precision: %d of %d decoder weights stay INT8 (%.1f%% of their elements, +%.1f MB held, +%.1f MB "
             "read a step; budget %.2fx the all-INT4 g128 size, held and read)", len(chosen), len(scored),
             100 * int8_elements / max(total, 1), spent / 1e6, spent_read / 1e6, fmt.budget)
    return tuple(sorted(chosen, key=_layer_order))


def _layer_order(key: str) -> tuple[int, str]:
    layer, name = key.split(".")
    return int(layer), name
