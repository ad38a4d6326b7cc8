"""Per-architecture facts in one table: config keys, tensor names, block layout.

Passes and the tracer never branch on ``model_type``; they read an :class:`ArchSpec`. Adding a
family means adding a table entry (and tests), not new branches elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ovshard.bundle.dims import ModelDims
from ovshard.errors import CheckpointError, UnsupportedArchitectureError

# rope types whose inverse frequencies are fixed for a config (so a constant cos/sin table is exact)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# rope types whose frequencies depend on the running sequence length; refused, see README
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class ArchSpec:
    """How one model family lays out its checkpoint. Tensor names are templates over ``{i}``."""

    model_types: tuple[str, ...]
    embed: str
    final_norm: str
    lm_head: str
    input_norm: str
    post_attention_norm: str
    q_proj: str
    k_proj: str
    v_proj: str
    o_proj: str
    gate_proj: str
    up_proj: str
    down_proj: str
    activations: tuple[str, ...]  # accepted values of config["hidden_act"]


LLAMA = ArchSpec(
    model_types=("llama",),
    embed="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    lm_head="lm_head.weight",
    input_norm="model.layers.{i}.input_layernorm.weight",
    post_attention_norm="model.layers.{i}.post_attention_layernorm.weight",
    q_proj="model.layers.{i}.self_attn.q_proj",
    k_proj="model.layers.{i}.self_attn.k_proj",
    v_proj="model.layers.{i}.self_attn.v_proj",
    o_proj="model.layers.{i}.self_attn.o_proj",
    gate_proj="model.layers.{i}.mlp.gate_proj",
    up_proj="model.layers.{i}.mlp.up_proj",
    down_proj="model.layers.{i}.mlp.down_proj",
    activations=("silu",),
)

ARCHITECTURES: dict[str, ArchSpec] = {t: spec for spec in (LLAMA,) for t in spec.model_types}


def arch_for(config: dict[str, Any]) -> ArchSpec:
    model_type = config.get("model_type")
    spec = ARCHITECTURES.get(str(model_type))
    if spec is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"config.json has model_type={model_type!r}; ovshard supports: {supported}. "
            "Convert the checkpoint to a supported family or add a table entry in ovshard/arch.py."
        )
    act = config.get("hidden_act", "silu")
    if act not in spec.activations:
        raise UnsupportedArchitectureError(
            f"hidden_act={act!r} is not supported for {model_type}; expected one of {spec.activations}"
        )
    return spec


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters, from transformers 5 ``rope_parameters`` or the legacy ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def read_dims(config: dict[str, Any]) -> ModelDims:
    """Validate ``config`` against the architecture table and return its dimensions."""
    arch_for(config)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        dims = ModelDims(
            model_type=str(config["model_type"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_type=str(rope_settings(config)["rope_type"]),
            rope_theta=float(rope_settings(config)["rope_theta"]),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}, which a {config['model_type']} model needs") from e
    if dims.num_heads % dims.num_kv_heads:
        raise CheckpointError(
            f"num_attention_heads={dims.num_heads} is not a multiple of num_key_value_heads={dims.num_kv_heads}"
        )
    if dims.rope_type in DYNAMIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {dims.rope_type!r} changes its frequencies with the running sequence length, so no "
            f"fixed cos/sin table is exact; supported rope types: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if dims.rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"unknown rope type {dims.rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    return dims


def layer_tensors(spec: ArchSpec, dims: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of layer ``i``'s tensors, as Hugging Face stores them."""
    q_out = dims.num_heads * dims.head_dim
    kv_out = dims.num_kv_heads * dims.head_dim
    linear = {
        spec.q_proj: (q_out, dims.hidden_size, dims.attention_bias),
        spec.k_proj: (kv_out, dims.hidden_size, dims.attention_bias),
        spec.v_proj: (kv_out, dims.hidden_size, dims.attention_bias),
        spec.o_proj: (dims.hidden_size, q_out, dims.attention_bias),
        spec.gate_proj: (dims.intermediate_size, dims.hidden_size, dims.mlp_bias),
        spec.up_proj: (dims.intermediate_size, dims.hidden_size, dims.mlp_bias),
        spec.down_proj: (dims.hidden_size, dims.intermediate_size, dims.mlp_bias),
    }
    shapes: dict[str, tuple[int, ...]] = {
        spec.input_norm.format(i=i): (dims.hidden_size,),
        spec.post_attention_norm.format(i=i): (dims.hidden_size,),
    }
    for prefix, (out_f, in_f, bias) in linear.items():
        shapes[prefix.format(i=i) + ".weight"] = (out_f, in_f)
        if bias:
            shapes[prefix.format(i=i) + ".bias"] = (out_f,)
    return shapes


def model_tensors(spec: ArchSpec, dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this family and these dimensions holds, in file order."""
    shapes: dict[str, tuple[int, ...]] = {spec.embed: (dims.vocab_size, dims.hidden_size)}
    for i in range(dims.num_layers):
        shapes.update(layer_tensors(spec, dims, i))
    shapes[spec.final_norm] = (dims.hidden_size,)
    if not dims.tie_word_embeddings:
        shapes[spec.lm_head] = (dims.vocab_size, dims.hidden_size)
    return shapes
