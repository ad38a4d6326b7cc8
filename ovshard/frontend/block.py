"""The decoder block of one checkpoint, as data: read once from config.json (by
:func:`ovshard.frontend.description.describe`), followed by the stage module.

:class:`Block` holds every choice the traced math makes that differs between families: norm offset,
q/k norms, four-norm "sandwich" layers, embedding scale, activation, attention scale and soft-capping,
partial rotary, and per layer its attention type (full or sliding window) and rotary table. Config keys
that change the math of some model but that this checkpoint's family does not implement are refused by
name (:data:`UNWIRED`): nothing in config.json is silently ignored. :class:`RopeTable` holds the
parameters of each rotary table the layers read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ovshard.bundle import names
from ovshard.bundle.dims import ModelDims
from ovshard.errors import UnsupportedArchitectureError
from ovshard.frontend.arch import DYNAMIC_ROPE_TYPES, STATIC_ROPE_TYPES, ArchSpec, activation, rope_settings

FULL, SLIDING, CHUNKED = names.FULL_MASK, "sliding_attention", "chunked_attention"
DEFAULT_ROPE = names.DEFAULT_TABLE  # the rotary table's key when every layer shares one
# rope types accepted only for families that wire them (longrope: up to original_max_position_embeddings)
FAMILY_ROPE_TYPES = {"longrope": "phi3"}

# Config keys that change some model's math, with the values that leave it unchanged. A family that does
# not list a key in ArchSpec.wires refuses a config where it holds any other value.
UNWIRED: dict[str, tuple[Any, ...]] = {
    "sliding_window": (None,),
    "use_sliding_window": (None, False),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "partial_rotary_factor": (None, 1.0),
    "use_bidirectional_attention": (None, False),
    "qk_layernorm": (None, False),
    "use_qk_norm": (None, False),
    "attention_chunk_size": (None,),
    "no_rope_layers": (None,),
    "logits_scaling": (None, 1.0),
    "embedding_multiplier": (None, 1.0),
    "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,),
    "logit_scale": (None, 1.0),
    # MoE models whose listed (or leading, or off-step) layers hold a dense MLP instead of experts
    "mlp_only_layers": (None, []),
    "decoder_sparse_step": (None, 1),
    "first_k_dense_replace": (None, 0),
    # sigmoid routing's groups, weight scale and shared experts (GLM-4.5, DeepSeek-V3)
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1.0),
    "n_shared_experts": (None, 0),
    "qkv_bias": (None, True),
    "rope_interleave": (None, False),  # DeepSeek's interleaved rotary pairs (multi-head latent attention)
    # DeepSeek's original config.json keys that transformers ignores and DeepSeek-V3's releases hold at these values:
    # another value (V2's softmax scoring, every other layer sparse) would compute unlike the model's own code
    "moe_layer_freq": (None, 1),
    "scoring_func": (None, "sigmoid"),
    "topk_method": (None, "noaux_tc"),  # Qwen2-MoE's switch for q, k, v biases: ovshard's qwen2_moe is always biased
}
ALWAYS_REFUSED: dict[str, tuple[Any, ...]] = {  # no family implements these
    "use_bidirectional_attention": (None, False),
}
# Llama4TextConfig's defaults, where a Llama 4 config.json omits the key
LLAMA4_DEFAULTS = {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": True,
                   "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}


@dataclass(frozen=True)
class Block:
    """What one checkpoint's decoder block computes, beyond its dimensions (:class:`ModelDims`)."""

    norm_offset: float  # RMSNorm output * (offset + w)
    qk_norm: bool  # per-head RMSNorm of q and k before rotary
    sandwich_norms: bool  # four norms a layer: before and after attention and MLP
    embed_scale: float | None  # embedding output * this (Gemma: sqrt(hidden))
    activation: str  # "silu", "gelu_tanh" or "gelu", of the gated MLP
    attention_scale: float  # scores = q.k * this
    attention_softcap: float | None  # scores = cap * tanh(scores / cap)
    final_softcap: float | None  # logits = cap * tanh(logits / cap)
    rotary_dim: int  # the leading head dims rotated (partial rotary); the rest pass through
    sliding_window: int | None  # a sliding layer sees keys fewer than this many visible positions back
    layer_types: tuple[str, ...]  # per layer: FULL or SLIDING
    rope_keys: tuple[str, ...]  # per layer: the rotary table it reads (DEFAULT_ROPE, or its layer type)
    # mixture of experts: the top-k routing weights (softmax over all experts, then the top k) are divided by
    # their sum (Mixtral always; Qwen3-MoE when norm_topk_prob)
    norm_topk: bool = False
    topk_softmax: bool = False  # the routing weights are a softmax over the top-k logits (gpt-oss)
    # gpt-oss's clamped SwiGLU: gate = min(gate, limit), up = clamp(up, -limit, limit) + 1,
    # out = up * gate * sigmoid(alpha * gate); None: the plain gated MLP
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False  # a learned logit per head joins each attention softmax (no SDPA op form)
    shared_expert_gated: bool = False  # the shared expert's output is scaled by sigmoid(x . w) (Qwen2-MoE)
    # GLM-4.5's routing: sigmoid scores; the experts' score-correction bias added for the choice only; the top k
    # chosen within the groups_per_token best of expert_groups groups (a group scored by its two best); the
    # chosen experts' plain sigmoid scores (renormalized when norm_topk) times routed_scaling
    sigmoid_routing: bool = False
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling: float = 1.0
    # multi-head latent attention (ModelDims.mla): its rotary dims are laid out in interleaved pairs (x0, x1), (x2,
    # x3), ... (DeepSeek's rope_interleave), not rotate_half's halves
    rope_interleave: bool = False
    # Llama 4: layers without rotary (its NoPE layers, global attention), the others' q and k L2-normed (a weightless
    # RMSNorm) after the rotary; a NoPE layer's queries scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
    # at position p (temperature = (floor_scale, attn_scale)); a CHUNKED layer attends within chunks of this many
    # positions; the router's top-k sigmoids scale each chosen expert's input
    nope_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    temperature: tuple[float, float] | None = None
    attention_chunk: int | None = None
    expert_input_scores: bool = False

    def mask_kind(self, layer: int) -> str:
        return self.layer_types[layer]

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None

    def chunk(self, kind: str) -> int | None:
        return self.attention_chunk if kind == CHUNKED else None

    def tuned(self, layers: range) -> bool:
        """Whether any of ``layers`` scales its queries by position (Llama 4's temperature-tuned NoPE layers)."""
        return self.temperature is not None and any(i in self.nope_layers for i in layers)

    def used(self, layers: range) -> tuple[list[str], list[str]]:
        """The rotary tables and mask kinds layers ``layers`` read, each once, in a fixed order."""
        ropes = sorted({self.rope_keys[i] for i in layers if i not in self.nope_layers})
        masks = sorted({self.layer_types[i] for i in layers})
        return ropes, masks


def _refuse_unwired(spec: ArchSpec, config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or {}
    flat_rope = rope if not all(isinstance(v, dict) for v in rope.values()) else {}
    for key, neutral in UNWIRED.items():
        value = config.get(key, flat_rope.get(key))
        if (key in ALWAYS_REFUSED or key not in spec.wires) and value not in neutral:
            raise UnsupportedArchitectureError(
                f"config.json sets {key}={value!r}, which changes the model's math, but ovshard's {spec.family} "
                f"family does not implement it (it would compute as if {key}={neutral[-1]!r}). Remove it only if "
                "the model was trained without it; otherwise this checkpoint is not supported yet."
            )


def _layer_types(spec: ArchSpec, config: dict[str, Any], layers: int, window: int | None) -> tuple[str, ...]:
    if window is None:
        return (FULL,) * layers
    listed = config.get("layer_types")
    if listed is not None:
        if len(listed) != layers or any(t not in (FULL, SLIDING) for t in listed):
            raise UnsupportedArchitectureError(
                f"config.json layer_types={listed!r}; expected {layers} entries, each {FULL!r} or {SLIDING!r}"
            )
        return tuple(listed)
    if spec.window_rule == "all":
        return (SLIDING,) * layers
    if spec.window_rule == "from_max_window_layers":
        first = int(config.get("max_window_layers", 0))
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    if spec.window_rule == "periodic":
        period = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or spec.window_period)
        return tuple(SLIDING if (i + 1) % period else FULL for i in range(layers))
    return (FULL,) * layers


def _check_rope(spec: ArchSpec, params: dict[str, Any], where: str) -> None:
    rope_type = params["rope_type"]
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r}{where} changes its frequencies with the running sequence length, so no "
            f"fixed cos/sin table is exact; supported rope types: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type not in STATIC_ROPE_TYPES and FAMILY_ROPE_TYPES.get(rope_type) != spec.family:
        families = f" (and {', '.join(f'{t} for {f}' for t, f in FAMILY_ROPE_TYPES.items())})"
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r}{where} is not supported for {spec.family}; supported: "
            f"{', '.join(STATIC_ROPE_TYPES)}{families}"
        )


@dataclass(frozen=True)
class RopeTable:
    """One rotary table's parameters (``rope_parameters``, or the legacy ``rope_scaling``/``rope_theta`` keys)."""

    rope_type: str  # a STATIC_ROPE_TYPES entry, or a FAMILY_ROPE_TYPES one of this family
    theta: float
    params: dict[str, Any]  # every parameter, as transformers' rope init function for rope_type reads them
    original_max_positions: int | None = None  # longrope: past this length its long factors take over


def read_block(spec: ArchSpec, config: dict[str, Any], dims: ModelDims) -> Block:
    """The block of a ``spec`` model whose language model's config is ``config``; refuses what it cannot
    compute exactly."""
    _refuse_unwired(spec, config)
    window = config.get("sliding_window")
    if spec.window_rule == "from_max_window_layers" and not config.get("use_sliding_window"):
        window = None
    chunked = _chunked_layers(spec, config, dims)
    layer_types = chunked.pop("layer_types", None) or _layer_types(spec, config, dims.num_layers,
                                                                   None if window is None else int(window))
    per_type_rope = _per_type_rope(config)
    rope_keys = tuple(t if per_type_rope else DEFAULT_ROPE for t in layer_types)
    flat_rope = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor",
                         flat_rope.get("partial_rotary_factor") if not per_type_rope else None)
    scalar = config.get("query_pre_attn_scalar")
    final_softcap = config.get("final_logit_softcapping")
    return Block(
        norm_offset=spec.norm_offset,
        qk_norm=spec.q_norm is not None and dims.qk_norm,
        sandwich_norms=spec.sandwich_norms,
        embed_scale=math.sqrt(dims.hidden_size) if spec.embed_scale else None,
        activation=activation(spec, config),
        attention_scale=_attention_scale(config, dims, scalar),
        attention_softcap=dims.attention_softcap,
        final_softcap=None if final_softcap is None else float(final_softcap),
        rotary_dim=dims.rope_head_dim if dims.mla else int(dims.head_dim * float(partial or 1.0)),
        sliding_window=None if window is None or SLIDING not in layer_types else int(window),
        layer_types=layer_types,
        rope_keys=rope_keys,
        norm_topk=spec.moe and not spec.topk_softmax and (spec.norm_topk_key is None
                                                          or bool(config.get(spec.norm_topk_key, spec.norm_topk_default))),
        topk_softmax=spec.topk_softmax,
        swiglu_limit=float(config["swiglu_limit"]) if "swiglu_limit" in spec.wires else None,
        swiglu_alpha=float(config.get("swiglu_alpha", 1.0)),
        attention_sinks=dims.attention_sinks,
        shared_expert_gated=spec.shared_expert_gate is not None and dims.shared_expert_size > 0,
        **_sigmoid_routing(spec, config, dims),
        rope_interleave=bool(chunked) or dims.mla and bool(config.get("rope_interleave", True)),  # V3's default
        expert_input_scores=dims.expert_input_scores,
        **chunked,
    )


def _chunked_layers(spec: ArchSpec, config: dict[str, Any], dims: ModelDims) -> dict[str, Any]:
    """Llama 4's attention fields of :class:`Block` (nothing for other families), as Llama4TextConfig derives them:
    ``no_rope_layers`` (1: rotary, 0: NoPE) or a NoPE layer every ``no_rope_layer_interval``; ``layer_types`` or
    CHUNKED on the rotary layers when ``attention_chunk_size`` is set (the rest FULL)."""
    if "no_rope_layers" not in spec.wires:
        return {}
    get = {key: config.get(key, default) for key, default in LLAMA4_DEFAULTS.items()}
    layers, interval = dims.num_layers, int(get["no_rope_layer_interval"])
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rope, list) or len(rope) < layers or any(v not in (0, 1) for v in rope):
        raise UnsupportedArchitectureError(f"config.json has no_rope_layers={rope!r}; expected {layers} or more "
                                           "entries, each 1 (a rotary layer) or 0 (a NoPE layer)")
    chunk = get["attention_chunk_size"]
    listed = config.get("layer_types") or [CHUNKED if rope[i] and chunk is not None else FULL for i in range(layers)]
    if len(listed) != layers or any(t not in (FULL, CHUNKED) for t in listed) or (CHUNKED in listed and not chunk):
        raise UnsupportedArchitectureError(
            f"config.json has layer_types={listed!r}, attention_chunk_size={chunk!r}; expected {layers} entries, "
            f"each {FULL!r} or {CHUNKED!r} (with a chunk size)")
    return {"layer_types": tuple(listed), "nope_layers": tuple(i for i in range(layers) if not rope[i]),
            "qk_l2_norm": bool(get["use_qk_norm"]), "attention_chunk": int(chunk) if CHUNKED in listed else None,
            "temperature": (float(get["floor_scale"]), float(get["attn_scale"])) if get["attn_temperature_tuning"]
            else None}


def _attention_scale(config: dict[str, Any], dims: ModelDims, scalar: Any) -> float:
    """Scores' scale: 1/sqrt(query_pre_attn_scalar or head_dim); multi-head latent attention with a scaled rope
    and ``mscale_all_dim`` (DeepSeek-V3's yarn) multiplies it by mscale squared, transformers' yarn_apply_mscale:
    mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (1 where factor <= 1)."""
    scale = float(scalar if scalar is not None else dims.head_dim) ** -0.5
    rope = rope_settings(config)
    mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
    if dims.mla and rope["rope_type"] != "default" and mscale_all_dim:
        factor = float(rope["factor"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _sigmoid_routing(spec: ArchSpec, config: dict[str, Any], dims: ModelDims) -> dict[str, Any]:
    """GLM-4.5's routing fields of :class:`Block` (nothing for other families), its groups checked."""
    if not spec.sigmoid_routing:
        return {}
    groups, chosen = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if groups < 1 or dims.num_experts % groups or not 1 <= chosen <= groups:
        raise UnsupportedArchitectureError(
            f"config.json has n_group={groups}, topk_group={chosen} for {dims.num_experts} experts; expected "
            "n_group dividing the expert count and 1 <= topk_group <= n_group")
    if chosen * (dims.num_experts // groups) < dims.experts_per_token:
        raise UnsupportedArchitectureError(
            f"config.json's topk_group={chosen} groups of {dims.num_experts // groups} experts hold fewer than "
            f"num_experts_per_tok={dims.experts_per_token}")
    return {"sigmoid_routing": True, "expert_groups": groups, "groups_per_token": chosen,
            "routed_scaling": float(config.get("routed_scaling_factor") or 1.0)}


def _per_type_rope(config: dict[str, Any]) -> bool:
    """Whether the rotary tables differ by layer type (Gemma 3): nested rope_parameters or a local base."""
    rope = config.get("rope_parameters")
    nested = isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values())
    return nested or "rope_local_base_freq" in config


def read_rope(spec: ArchSpec, config: dict[str, Any], block: Block, dims: ModelDims) -> dict[str, RopeTable]:
    """The rotary tables ``block``'s layers read, by key; refuses rope types no fixed table computes exactly."""
    tables = {}
    for key in sorted(set(block.rope_keys)):
        params = rope_settings(config, None if key == DEFAULT_ROPE else key)
        _check_rope(spec, params, "" if key == DEFAULT_ROPE else f" of {key} layers")
        original = None
        if params["rope_type"] == "longrope":
            original = int(config.get("original_max_position_embeddings")
                           or params.get("original_max_position_embeddings") or dims.max_position_embeddings)
        tables[key] = RopeTable(str(params["rope_type"]), float(params["rope_theta"]), params, original)
    return tables
