"""Pieces of a stage, traced one at a time for the streamed compile: the memory of one layer, not a stage.

A stage is ``[embedding] -> prologue -> layer start .. layer end-1 -> [final norm -> lm_head]``. The
prologue computes what every layer shares (rotary cos/sin, the 4-D attention mask); each layer is its
own graph; the embedding and the lm_head, the largest matrices of a model, are never traced whole:
:func:`matrix_rows` hands them out in row chunks. Pieces meet at the port names of ``names``
(``names.piece_hidden(i)``, ``PIECE_COS`` ...), which ``ovshard.ir.splice`` joins into one stage graph
that computes exactly what the whole-stage trace (``ovshard.frontend.trace``) computes: both run the
same functions of ``ovshard.frontend.stage_module``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov
import torch
from torch import nn

from ovshard.bundle import names
from ovshard.bundle.stage import StageSpec
from ovshard.frontend.mla import name_kv_b
from ovshard.frontend.rope import rotary_tables
from ovshard.frontend.stage_module import (
    EmbedScaleModule,
    FinalNormModule,
    LayersModule,
    PrologueModule,
    SoftcapModule,
    Weights,
)
from ovshard.frontend.trace import load_layer

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

_BATCH, _SEQ, _PAST = 2, 3, 4  # example shapes for tracing; every axis but the model's own is dynamic
Port = tuple[str, ov.PartialShape, ov.Type]


def _trace(module: nn.Module, example: tuple, inputs: Sequence[Port], outputs: Sequence[str]) -> ov.Model:
    """torch.jit.trace + OpenVINO's PyTorch front end; I/O named ``inputs``/``outputs``."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module.eval(), example, check_trace=False)
        model = ov.convert_model(traced, example_input=example, input=[(s, t) for _, s, t in inputs])
    del traced
    name_kv_b(model)
    for port, (name, _, _) in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for param, (name, _, _) in zip(model.get_parameters(), inputs, strict=True):
        param.set_friendly_name(name)
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    return model


def _dyn(*dims: int | None) -> ov.PartialShape:
    return ov.PartialShape([ov.Dimension.dynamic() if d is None else d for d in dims])


def context_ports(ckpt: Checkpoint, layers: range) -> list[Port]:
    """The prologue's outputs that layers ``layers`` read: cos, sin per rotary table, a mask per kind, then the NoPE
    layers' query scale where the block tunes their temperature (Llama 4)."""
    ropes, masks = ckpt.block.used(layers)
    rotary_dim, f32 = ckpt.block.rotary_dim, ov.Type.f32
    ports: list[Port] = []
    for key in ropes:
        ports += [(names.piece_cos(key), _dyn(None, None, rotary_dim), f32),
                  (names.piece_sin(key), _dyn(None, None, rotary_dim), f32)]
    ports += [(names.piece_mask(kind), _dyn(None, 1, None, None), f32) for kind in masks]
    return ports + ([(names.PIECE_TEMPERATURE, _dyn(None, 1, None, 1), f32)] if ckpt.block.tuned(layers) else [])


def prologue_piece(ckpt: Checkpoint, stage: StageSpec, max_positions: int | None) -> ov.Model:
    """(attention_mask, position_ids) -> the rotary cos/sin and 4-D masks the stage's layers read."""
    tables = rotary_tables(ckpt.description, stage.layers, max_positions)
    mask = torch.ones(_BATCH, _PAST + _SEQ, dtype=torch.int64)
    positions = torch.arange(_PAST, _PAST + _SEQ, dtype=torch.int64).expand(_BATCH, _SEQ).contiguous()
    ids = _dyn(None, None)
    return _trace(PrologueModule(ckpt.block, stage.layers, tables), (mask, positions),
                  [(names.ATTENTION_MASK, ids, ov.Type.i64), (names.POSITION_IDS, ids, ov.Type.i64)],
                  [name for name, _, _ in context_ports(ckpt, stage.layers)])


def layers_piece(ckpt: Checkpoint, start: int, end: int, stage: StageSpec,
                 weights: list[Weights] | None = None) -> ov.Model:
    """Decoder layers [start, end): (hidden, cos, sin ..., masks ..., past k/v ...) -> (hidden, present k/v ...).

    ``weights``: the layers' float32 weights where the caller loaded them (the graph's constants share their memory),
    else loaded here."""
    d, layers = ckpt.dims, range(start, end)
    weights = weights if weights is not None else [load_layer(ckpt, i, stage) for i in layers]
    module = LayersModule(d, ckpt.block, layers, weights)
    context = context_ports(ckpt, layers)
    context_example = [torch.ones(_BATCH, 1, _SEQ, 1) if name == names.PIECE_TEMPERATURE
                       else torch.zeros(_BATCH, 1, _SEQ, _PAST + _SEQ) if shape.rank.get_length() == 4
                       else torch.randn(_BATCH, _SEQ, ckpt.block.rotary_dim) for name, shape, _ in context]
    kv_examples = [torch.zeros(_BATCH, d.cache_heads, _PAST, dim) for _ in layers for dim in d.cache_dims]
    example = (torch.randn(_BATCH, _SEQ, d.hidden_size), *context_example, *kv_examples)
    f32 = ov.Type.f32
    inputs = [(names.piece_hidden(start), _dyn(None, None, d.hidden_size), f32), *context]
    inputs += [(past, _dyn(None, d.cache_heads, None, d.cache_dims[n % 2]), f32)
               for n, past in enumerate(p for p, _ in names.kv_pairs(layers))]
    outputs = [names.piece_hidden(end), *(present for _, present in names.kv_pairs(layers))]
    model = _trace(module, example, inputs, outputs)
    del module
    return model


def embed_scale_piece(ckpt: Checkpoint) -> ov.Model:
    """The gathered embedding rows -> times the family's embedding scale (Gemma: sqrt(hidden))."""
    d = ckpt.dims
    return _trace(EmbedScaleModule(ckpt.block), (torch.randn(_BATCH, _SEQ, d.hidden_size),),
                  [(names.PIECE_EMBEDDED, _dyn(None, None, d.hidden_size), ov.Type.f32)], [names.piece_hidden(0)])


def final_norm_piece(ckpt: Checkpoint) -> ov.Model:
    """hidden -> the final RMSNorm's output; the lm_head MatMul is joined on from row chunks."""
    d = ckpt.dims
    module = FinalNormModule(d, ckpt.block, ckpt.load(ckpt.spec.final_norm))
    end = names.piece_hidden(d.num_layers)
    return _trace(module, (torch.randn(_BATCH, _SEQ, d.hidden_size),),
                  [(end, _dyn(None, None, d.hidden_size), ov.Type.f32)], [names.PIECE_NORMED])


def softcap_piece(ckpt: Checkpoint) -> ov.Model:
    """The lm_head's logits -> soft-capped logits (Gemma 2)."""
    vocab = ckpt.dims.vocab_size
    return _trace(SoftcapModule(ckpt.block), (torch.randn(_BATCH, _SEQ, vocab),),
                  [(names.PIECE_HEAD, _dyn(None, None, vocab), ov.Type.f32)], [names.LOGITS])


def chunk_rows(rows: int, cols: int, chunk_bytes: int = 64 << 20) -> int:
    """Rows per chunk: about ``chunk_bytes`` of f32, even (so packed 4-bit rows start on a byte), at most all."""
    per_chunk = max(2, (chunk_bytes // (4 * cols)) // 2 * 2)
    return rows if per_chunk >= rows else per_chunk


def matrix_rows(ckpt: Checkpoint, name: str, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, f32 rows [chunk, cols]) of the 2-D tensor ``name``; only one chunk is in memory at a time."""
    rows = ckpt.tensor_info(name)[1][0]
    for start in range(0, rows, chunk):
        yield start, ckpt.load_rows(name, start, min(rows, start + chunk)).numpy()


def embedding_chunk(rows: np.ndarray) -> tuple[ov.Model, ov.Output]:
    """input_ids -> Gather(rows, axis 0): a model NNCF compresses as an embedding; and the weight it reads."""
    ids = ov.opset13.parameter(_dyn(None, None), ov.Type.i64, name=names.INPUT_IDS)
    ids.output(0).get_tensor().set_names({names.INPUT_IDS})
    weight = ov.opset13.constant(rows)
    gather = ov.opset13.gather(weight, ids, ov.opset13.constant(np.int64(0)))
    return ov.Model([gather], [ids], "embedding_chunk"), gather.input_value(0)


def head_chunk(rows: np.ndarray) -> tuple[ov.Model, ov.Output]:
    """normed hidden -> MatMul(x, rows^T): a model NNCF compresses as a (last) MatMul; and its weight."""
    x = ov.opset13.parameter(_dyn(None, None, rows.shape[1]), ov.Type.f32, name=names.PIECE_NORMED)
    x.output(0).get_tensor().set_names({names.PIECE_NORMED})
    matmul = ov.opset13.matmul(x, ov.opset13.constant(rows), transpose_a=False, transpose_b=True)
    return ov.Model([matmul], [x], "head_chunk"), matmul.input_value(1)
