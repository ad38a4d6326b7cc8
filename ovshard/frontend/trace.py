"""Stage tracer: load one stage's tensors, trace the stage module, convert it to OpenVINO.

Only the stage's own tensors are read: its layers, the embedding in the first stage, the final norm
and lm_head (or the tied embedding) in the last.

Two front ends turn the same stage module into the same contract (I/O names, types, partial shapes,
attention as one ScaledDotProductAttention per layer), so one pass pipeline serves both:

- ``torchscript``: ``torch.jit.trace`` + OpenVINO's PyTorch front end (the default).
- ``onnx``: ``torch.onnx.export`` (the torch.export-based exporter, opset 23) to a temporary file +
  OpenVINO's ONNX front end. Opset 23 is the first with an ONNX ``Attention`` op: the exporter maps
  ``F.scaled_dot_product_attention`` to it and OpenVINO turns it into ScaledDotProductAttention with
  the concatenated K/V as direct inputs, the shape the CPU plugin's StatefulSDPAFusion matches. Lower
  opsets (and the legacy TorchScript-based exporter) decompose attention into MatMul/Softmax;
  OpenVINO re-fuses that into an SDPA whose keys pass through extra Transposes (and, with the
  torch.export exporter, Reshapes), so the KV cache is never fused into attention on CPU. At opset 24
  OpenVINO 2026.4 converts ``Attention`` with extra Pad ops, and the fusion fails too.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import openvino as ov
import torch

from ovshard.bundle import names
from ovshard.bundle.dims import ModelDims
from ovshard.bundle.stage import StageSpec
from ovshard.errors import CheckpointError, OvshardError
from ovshard.frontend.mla import absorbed_kv_b, name_kv_b
from ovshard.frontend.rope import rotary_tables
from ovshard.frontend.stage_module import StageModule, Weights, layer_weights
from ovshard.frontend.tensors import MLA_NAMES, MLA_NORMS, mla_shapes

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

FRONTENDS = ("torchscript", "onnx")
ONNX_OPSET = 23  # the first opset with an Attention op (see the module docstring)


def _load(ckpt: Checkpoint, name: str, stage: StageSpec) -> torch.Tensor:
    try:
        return ckpt.load(name)
    except KeyError as e:
        raise CheckpointError(f"stage {stage.index}: tensor {name!r} is missing from {ckpt.path}") from e
    except CheckpointError as e:
        raise CheckpointError(f"stage {stage.index}: {e}") from e


def _norms(ckpt: Checkpoint, i: int, stage: StageSpec) -> dict[str, torch.Tensor]:
    """Layer ``i``'s norm scales by the role the stage module reads them in."""
    spec = ckpt.spec
    roles: dict[str, str | None] = {"attn_norm": spec.input_norm}
    if spec.sandwich_norms:
        roles |= {"attn_out_norm": spec.post_attention_norm, "mlp_norm": spec.pre_feedforward_norm,
                  "mlp_out_norm": spec.post_feedforward_norm}
    else:
        roles["mlp_norm"] = spec.post_attention_norm
    if ckpt.block.qk_norm:
        roles |= {"q_norm": spec.q_norm, "k_norm": spec.k_norm}
    return {role: _load(ckpt, template.format(i=i), stage) for role, template in roles.items() if template}


def _split(weight: torch.Tensor, bias: torch.Tensor | None,
           sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Rows of a fused projection (Phi-3's qkv_proj, gate_up_proj) as separate contiguous (weight, bias)."""
    weights = [part.contiguous() for part in torch.split(weight, sizes, dim=0)]
    biases = [None] * len(sizes) if bias is None else [part.contiguous() for part in torch.split(bias, sizes, dim=0)]
    return list(zip(weights, biases, strict=True))


def _experts(ckpt: Checkpoint, i: int, stage: StageSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Layer ``i``'s router and its experts' gate, up and down weights, each stacked [experts, out, in]."""
    spec, experts = ckpt.spec, range(ckpt.dims.num_experts)
    router = spec.router.format(i=i) if spec.router else ""
    router_bias = _load(ckpt, router + ".bias", stage) if spec.router_bias else None
    if spec.stacked_halves:  # Llama 4: gate_up [E, hidden, 2 * size] holds gate then up; no biases
        assert spec.stacked_experts
        prefix = spec.stacked_experts.format(i=i)
        gate_up = _load(ckpt, prefix + ".gate_up_proj", stage).transpose(1, 2)  # [E, 2 * size, hidden]
        gate, up = (part.contiguous() for part in gate_up.chunk(2, dim=1))
        return {"router": (_load(ckpt, router + ".weight", stage), router_bias), "experts_gate": (gate, None),
                "experts_up": (up, None),
                "experts_down": (_load(ckpt, prefix + ".down_proj", stage).transpose(1, 2).contiguous(), None),
                **_shared_expert(ckpt, i, stage)}
    if spec.stacked_experts:  # [E, in, out] as x @ W: transposed to [E, out, in] like every other weight
        prefix = spec.stacked_experts.format(i=i)
        return {"router": (_load(ckpt, router + ".weight", stage), router_bias),
                "experts_gate_up": (_load(ckpt, prefix + ".gate_up_proj", stage).transpose(1, 2).contiguous(),
                                    _load(ckpt, prefix + ".gate_up_proj_bias", stage)),
                "experts_down": (_load(ckpt, prefix + ".down_proj", stage).transpose(1, 2).contiguous(),
                                 _load(ckpt, prefix + ".down_proj_bias", stage))}
    assert spec.expert_gate and spec.expert_up and spec.expert_down

    def stacked(template: str) -> torch.Tensor:
        """[experts, out, in], filled one expert at a time: one copy of the layer's experts, not two."""
        names = [template.replace("{i}", str(i)).replace("{e}", str(e)) + ".weight" for e in experts]
        out: torch.Tensor | None = None
        for e, name in enumerate(names):
            weight = _load(ckpt, name, stage)
            if out is None:
                out = torch.empty((len(names), *weight.shape), dtype=weight.dtype)
            out[e] = weight
        assert out is not None
        return out

    found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        "router": (_load(ckpt, router + ".weight", stage), router_bias),
        "experts_gate": (stacked(spec.expert_gate), None), "experts_up": (stacked(spec.expert_up), None),
        "experts_down": (stacked(spec.expert_down), None)}
    return found | _shared_expert(ckpt, i, stage)


def _shared_expert(ckpt: Checkpoint, i: int, stage: StageSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Layer ``i``'s shared expert (gate, up, down) and its gate, where the family has them."""
    spec = ckpt.spec
    found: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if spec.shared_expert and ckpt.dims.shared_expert_size:
        shared = spec.shared_expert.format(i=i)
        for key in ("gate", "up", "down"):
            found[f"shared_{key}"] = (_load(ckpt, f"{shared}.{key}_proj.weight", stage), None)
        if spec.shared_expert_gate:
            found["shared_router"] = (_load(ckpt, spec.shared_expert_gate.format(i=i) + ".weight", stage), None)
    return found


def _mla_attention(ckpt: Checkpoint, i: int, stage: StageSpec) -> tuple[
        dict[str, tuple[torch.Tensor, torch.Tensor | None]], dict[str, torch.Tensor]]:
    """Layer ``i``'s multi-head latent attention: its projections (:func:`mla_shapes`' keys) and latent norms."""
    assert ckpt.spec.mla
    dims, prefix = ckpt.dims, ckpt.spec.mla.format(i=i)
    linears = {}
    for key in mla_shapes(dims):
        name, biased = MLA_NAMES[key]
        bias = _load(ckpt, f"{prefix}.{name}.bias", stage) if biased and dims.attention_bias else None
        linears[key] = (_load(ckpt, f"{prefix}.{name}.weight", stage), bias)
    if dims.latent_cache:  # kv_b absorbed: its two halves by head (MLA_NAMES: never biased); kv_b itself stays for
        # the INT8 choice's scoring (plan/precision.py) and is never traced
        linears.update((half, (w, None)) for half, w in absorbed_kv_b(dims, linears["kv_b"][0]).items())
    norms = {role: _load(ckpt, f"{prefix}.{name}.weight", stage) for role, name in MLA_NORMS.items()
             if role != "q_a_norm" or dims.q_lora_rank}
    return linears, norms


def load_layer(ckpt: Checkpoint, i: int, stage: StageSpec) -> Weights:
    spec, dims = ckpt.spec, ckpt.dims

    def linear(template: str, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        prefix = template.format(i=i)
        return _load(ckpt, prefix + ".weight", stage), _load(ckpt, prefix + ".bias", stage) if bias else None

    linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    mla_norms: dict[str, torch.Tensor] = {}
    if spec.mla:
        linears, mla_norms = _mla_attention(ckpt, i, stage)
    elif spec.qkv_proj:
        q_out, kv_out = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        parts = _split(*linear(spec.qkv_proj, dims.attention_bias), [q_out, kv_out, kv_out])
        linears.update(zip(("q", "k", "v"), parts, strict=True))
    else:
        for key, template in (("q", spec.q_proj), ("k", spec.k_proj), ("v", spec.v_proj)):
            linears[key] = linear(template, dims.attention_bias)
    if not spec.mla:
        linears["o"] = linear(spec.o_proj, dims.o_bias)
    sparse = dims.sparse(i)
    if sparse:
        linears.update(_experts(ckpt, i, stage))
    elif spec.gate_up_proj:
        parts = _split(*linear(spec.gate_up_proj, dims.mlp_bias), [dims.intermediate_size] * 2)
        linears.update(zip(("gate", "up"), parts, strict=True))
    else:
        linears["gate"] = linear(spec.gate_proj, dims.mlp_bias)
        linears["up"] = linear(spec.up_proj, dims.mlp_bias)
    if not sparse:
        linears["down"] = linear(spec.down_proj, dims.mlp_bias)
    extra = {"sinks": _load(ckpt, spec.sinks.format(i=i), stage)} if spec.sinks else {}
    if sparse and spec.router_correction:
        extra["router_correction"] = _load(ckpt, spec.router_correction.format(i=i), stage)
    return layer_weights({**_norms(ckpt, i, stage), **mla_norms, **extra}, linears)


def build_stage_module(ckpt: Checkpoint, stage: StageSpec, max_positions: int | None = None) -> StageModule:
    spec, dims = ckpt.spec, ckpt.dims
    tables = rotary_tables(ckpt.description, stage.layers, max_positions)
    layers = []
    for i in range(stage.start, stage.end):
        log.info("stage %d: loading layer %d (%d of %d)", stage.index, i, i - stage.start + 1, stage.end - stage.start)
        layers.append(load_layer(ckpt, i, stage))
    embed = _load(ckpt, spec.embed, stage) if stage.first else None
    final_norm = lm_head = None
    if stage.last:
        final_norm = _load(ckpt, spec.final_norm, stage)
        if dims.tie_word_embeddings:
            lm_head = embed if embed is not None else _load(ckpt, spec.embed, stage)
        else:
            lm_head = _load(ckpt, spec.lm_head, stage)
    return StageModule(dims, ckpt.block, stage.layers, layers, tables, embed, final_norm, lm_head)


def _example_inputs(dims: ModelDims, stage: StageSpec, batch: int = 2, seq: int = 3, past: int = 4):
    if stage.first:
        x = torch.arange(batch * seq, dtype=torch.int64).reshape(batch, seq) % dims.vocab_size
    else:
        x = torch.randn(batch, seq, dims.hidden_size)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq, dtype=torch.int64).expand(batch, seq).contiguous()
    kv = [torch.zeros(batch, dims.cache_heads, past, dim) for _ in stage.layers for dim in dims.cache_dims]
    return (x, mask, positions, *kv)


def input_names(stage: StageSpec) -> list[str]:
    return names.stage_inputs(stage.first, stage.layers)


def output_names(stage: StageSpec) -> list[str]:
    return names.stage_outputs(stage.last, stage.layers)


def _input_signature(dims: ModelDims, stage: StageSpec) -> list[tuple[ov.PartialShape, ov.Type]]:
    dyn = ov.Dimension.dynamic()
    kv = [(ov.PartialShape([dyn, dims.cache_heads, dyn, dim]), ov.Type.f32) for dim in dims.cache_dims]
    first = (
        (ov.PartialShape([dyn, dyn]), ov.Type.i64)
        if stage.first
        else (ov.PartialShape([dyn, dyn, dims.hidden_size]), ov.Type.f32)
    )
    ids = (ov.PartialShape([dyn, dyn]), ov.Type.i64)
    return [first, ids, ids] + kv * (stage.end - stage.start)


def _dynamic_shapes(stage: StageSpec) -> tuple:
    """Dynamic axes of forward()'s arguments for torch.export: batch, seq and past length.

    Every axis is ``Dim.DYNAMIC``: the exporter works out how they relate (the mask is past + seq
    long) rather than being told, and the ONNX graph leaves them all free.
    """
    dynamic = torch.export.Dim.DYNAMIC
    x = {0: dynamic, 1: dynamic}  # [batch, seq] ids or [batch, seq, hidden]
    mask = {0: dynamic, 1: dynamic}  # [batch, past + seq]
    positions = {0: dynamic, 1: dynamic}  # [batch, seq]
    past = tuple({0: dynamic, 2: dynamic} for _ in range(2 * (stage.end - stage.start)))  # [b, kv_heads, past, d]
    return (x, mask, positions, past)  # *past is one tuple


@contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Hold back INFO/WARNING records of one logger (torch's exporter warns that torchvision is absent)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export_onnx(ckpt: Checkpoint, stage: StageSpec, path: Path, max_positions: int | None) -> None:
    """Write the stage module to ``path`` as ONNX, its weights to an external data file beside it.

    The module (the stage's f32 weights) lives only in this function, so it is freed before
    OpenVINO reads the file back. ``optimize=False``: onnxscript's optimizer (0.7.2) keeps the last
    graph it rewrote, weights included, in module-level rewrite rules, so every stage's f32 weights
    would stay alive until the process exits; OpenVINO folds constants itself anyway.
    """
    dims = ckpt.dims
    try:
        import onnxscript  # noqa: F401  (the torch.export-based exporter is built on it)
    except ImportError as e:
        raise OvshardError("the onnx front end needs the onnxscript package; install ovshard[compile] "
                           "or use the torchscript front end") from e
    module = build_stage_module(ckpt, stage, max_positions).eval()
    with torch.no_grad(), warnings.catch_warnings(), _quiet_logger("torch.onnx._internal.exporter._registration"):
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations, nothing to act on
        torch.onnx.export(
            module, _example_inputs(dims, stage), path, dynamo=True, opset_version=ONNX_OPSET,
            input_names=input_names(stage), output_names=output_names(stage),
            dynamic_shapes=_dynamic_shapes(stage), external_data=True, optimize=False, verbose=False,
        )


def _onnx_model(ckpt: Checkpoint, stage: StageSpec, max_positions: int | None) -> ov.Model:
    """Export to a temporary folder and convert the file.

    OpenVINO maps the external weights file instead of reading it, so the model's weights stay
    backed by that (deleted) file until the model is freed: the temporary folder (``TMPDIR``) needs
    room for the stage's f32 weights. Where an open mapping blocks deletion (Windows), the folder
    would be left behind rather than fail the compile.
    """
    with tempfile.TemporaryDirectory(prefix="ovshard-onnx-", ignore_cleanup_errors=True) as tmp:
        path = Path(tmp) / f"stage_{stage.index}.onnx"
        log.info("stage %d: exporting to ONNX (opset %d)", stage.index, ONNX_OPSET)
        _export_onnx(ckpt, stage, path, max_positions)
        gc.collect()  # the torch weights are garbage now: free them before OpenVINO maps its copy
        return ov.convert_model(path)


def _torchscript_model(ckpt: Checkpoint, stage: StageSpec, max_positions: int | None) -> ov.Model:
    dims = ckpt.dims
    module = build_stage_module(ckpt, stage, max_positions).eval()
    example = _example_inputs(dims, stage)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, example, check_trace=False)
        model = ov.convert_model(traced, example_input=example, input=_input_signature(dims, stage))
    del traced, module
    name_kv_b(model)
    return model


def trace_stage(ckpt: Checkpoint, stage: StageSpec, frontend: str = "torchscript",
                max_positions: int | None = None) -> ov.Model:
    """Trace the stage through ``frontend`` (one of FRONTENDS) and convert it; I/O carry the contract's names."""
    if frontend not in FRONTENDS:
        raise ValueError(f"front end {frontend!r}; expected one of {FRONTENDS}")
    if frontend == "onnx":
        model = _onnx_model(ckpt, stage, max_positions)
    else:
        model = _torchscript_model(ckpt, stage, max_positions)
    for port, name in zip(model.inputs, input_names(stage), strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, output_names(stage), strict=True):
        port.get_tensor().set_names({name})
    for param, name in zip(model.get_parameters(), input_names(stage), strict=True):
        param.set_friendly_name(name)
    return model
