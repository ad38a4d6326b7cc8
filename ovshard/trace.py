"""Stage tracer: load one stage's tensors, trace the stage module, convert it to OpenVINO.

Only the stage's own tensors are read: its layers, the embedding in the first stage, the final norm
and lm_head (or the tied embedding) in the last.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import openvino as ov
import torch

from ovshard import names
from ovshard.arch import ArchSpec, ModelDims
from ovshard.errors import CheckpointError
from ovshard.pass_manager import StageSpec
from ovshard.rope import rotary_frequencies
from ovshard.stage_module import StageModule, Weights, layer_weights

if TYPE_CHECKING:
    from ovshard.checkpoint import Checkpoint

log = logging.getLogger(__name__)

_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def _load(ckpt: Checkpoint, name: str, stage: StageSpec) -> torch.Tensor:
    try:
        return ckpt.load(name)
    except KeyError as e:
        raise CheckpointError(f"stage {stage.index}: tensor {name!r} is missing from {ckpt.path}") from e
    except CheckpointError as e:
        raise CheckpointError(f"stage {stage.index}: {e}") from e


def load_layer(ckpt: Checkpoint, spec: ArchSpec, dims: ModelDims, i: int, stage: StageSpec) -> Weights:
    linears = {}
    templates = dict(zip(_LINEARS, (spec.q_proj, spec.k_proj, spec.v_proj, spec.o_proj,
                                    spec.gate_proj, spec.up_proj, spec.down_proj), strict=False))
    for key, template in templates.items():
        prefix = template.format(i=i)
        has_bias = dims.attention_bias if key in ("q", "k", "v", "o") else dims.mlp_bias
        bias = _load(ckpt, prefix + ".bias", stage) if has_bias else None
        linears[key] = (_load(ckpt, prefix + ".weight", stage), bias)
    return layer_weights(
        _load(ckpt, spec.input_norm.format(i=i), stage), _load(ckpt, spec.post_attention_norm.format(i=i), stage),
        linears,
    )


def build_stage_module(ckpt: Checkpoint, spec: ArchSpec, dims: ModelDims, stage: StageSpec) -> StageModule:
    inv_freq, scaling = rotary_frequencies(ckpt.path, dims)
    layers = []
    for i in range(stage.start, stage.end):
        log.info("stage %d: loading layer %d (%d of %d)", stage.index, i, i - stage.start + 1, stage.end - stage.start)
        layers.append(load_layer(ckpt, spec, dims, i, stage))
    embed = _load(ckpt, spec.embed, stage) if stage.first else None
    final_norm = lm_head = None
    if stage.last:
        final_norm = _load(ckpt, spec.final_norm, stage)
        if dims.tie_word_embeddings:
            lm_head = embed if embed is not None else _load(ckpt, spec.embed, stage)
        else:
            lm_head = _load(ckpt, spec.lm_head, stage)
    return StageModule(dims, layers, inv_freq, scaling, embed, final_norm, lm_head)


def _example_inputs(dims: ModelDims, stage: StageSpec, batch: int = 2, seq: int = 3, past: int = 4):
    if stage.first:
        x = torch.arange(batch * seq, dtype=torch.int64).reshape(batch, seq) % dims.vocab_size
    else:
        x = torch.randn(batch, seq, dims.hidden_size)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq, dtype=torch.int64).expand(batch, seq).contiguous()
    kv = [torch.zeros(batch, dims.num_kv_heads, past, dims.head_dim) for _ in range(2 * (stage.end - stage.start))]
    return (x, mask, positions, *kv)


def input_names(stage: StageSpec) -> list[str]:
    first = names.INPUT_IDS if stage.first else names.HIDDEN_STATES
    kv = [n for i in range(stage.start, stage.end) for n in (names.past_key(i), names.past_value(i))]
    return [first, names.ATTENTION_MASK, names.POSITION_IDS, *kv]


def output_names(stage: StageSpec) -> list[str]:
    first = names.LOGITS if stage.last else names.HIDDEN_STATES
    kv = [n for i in range(stage.start, stage.end) for n in (names.present_key(i), names.present_value(i))]
    return [first, *kv]


def _input_signature(dims: ModelDims, stage: StageSpec) -> list[tuple[ov.PartialShape, ov.Type]]:
    dyn = ov.Dimension.dynamic()
    kv = (ov.PartialShape([dyn, dims.num_kv_heads, dyn, dims.head_dim]), ov.Type.f32)
    first = (
        (ov.PartialShape([dyn, dyn]), ov.Type.i64)
        if stage.first
        else (ov.PartialShape([dyn, dyn, dims.hidden_size]), ov.Type.f32)
    )
    ids = (ov.PartialShape([dyn, dyn]), ov.Type.i64)
    return [first, ids, ids] + [kv] * (2 * (stage.end - stage.start))


def trace_stage(ckpt: Checkpoint, spec: ArchSpec, dims: ModelDims, stage: StageSpec) -> ov.Model:
    """Trace the stage with torch.jit.trace and convert it; I/O carry the contract's names."""
    module = build_stage_module(ckpt, spec, dims, stage).eval()
    example = _example_inputs(dims, stage)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, example, check_trace=False)
        model = ov.convert_model(traced, example_input=example, input=_input_signature(dims, stage))
    del traced, module
    for port, name in zip(model.inputs, input_names(stage), strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, output_names(stage), strict=True):
        port.get_tensor().set_names({name})
    for param, name in zip(model.get_parameters(), input_names(stage), strict=True):
        param.set_friendly_name(name)
    return model
