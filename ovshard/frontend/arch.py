"""Model families as data: tensor names and block layout per family, one table.

Passes, the tracer and the tensor reader never branch on ``model_type``; they read an :class:`ArchSpec`
(what a family stores and how its block is wired) and a :class:`~ovshard.frontend.block.Block` (the
numbers of one checkpoint's block), both read once from its config.json into a
:class:`~ovshard.frontend.description.ModelDescription`. Adding a family is a table entry here, the config
keys it wires, and tests; see docs/families.md, "Adding a family". What a checkpoint of a family stores,
layer by layer (a mixture-of-experts model's dense layers included), is :mod:`ovshard.frontend.tensors`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypedDict

from ovshard.bundle.dims import ModelDims
from ovshard.errors import CheckpointError, UnsupportedArchitectureError

# rope types whose inverse frequencies are fixed for a config (so a constant cos/sin table is exact)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# rope types whose frequencies depend on the running sequence length; refused, see README
DYNAMIC_ROPE_TYPES = ("dynamic",)
# mixture-of-experts families the table does not hold, refused by name with what each would need
UNSUPPORTED_MOE = {
    "deepseek_v2": "its softmax routing (topk_method greedy or group_limited_greedy, no correction bias) "
                   "and its config keys as a family; its multi-head latent attention is deepseek_v3's",
    "phimoe": "sparsemixer routing (a different top-2 selection than softmax top-k)",
    "olmoe": "q/k norms over the whole projection (not per head) with its MoE block",
    "granitemoe": "Granite's embedding/residual/attention/logit multipliers with its MoE block",
    "jamba": "Mamba state-space layers interleaved with attention (no KV cache form)",
    "dbrx": "DBRX's fused expert tensors, clipped QKV and LayerNorm (not RMSNorm)",
}
# activations the block computes, by the names transformers gives them
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}


# How a family picks its sliding layers when config.json lists no layer_types (older configs):
# "none": no layer slides; "all": every layer, when sliding_window is set (Mistral, Phi-3);
# "from_max_window_layers": layers from max_window_layers on, when use_sliding_window (Qwen2/3);
# "periodic": all but every window_period-th layer (Gemma 2: 2; Gemma 3: sliding_window_pattern, 6).
WINDOW_RULES = ("none", "all", "from_max_window_layers", "periodic")
# Which layers of a mixture-of-experts model hold a dense MLP (of intermediate_size) instead of the experts, as
# transformers decides: "none": every layer is sparse; "sparse_step" (Qwen MoE): layer i is dense when listed in
# mlp_only_layers or when (i + 1) is not a multiple of decoder_sparse_step; "first_k" (GLM-4.5, DeepSeek): the
# layers below first_k_dense_replace are dense; "moe_layers" (Llama 4): the layers not listed in moe_layers (or, without
# it, all but every interleave_moe_layer_step-th) are dense.
DENSE_RULES = ("none", "sparse_step", "first_k", "moe_layers")


@dataclass(frozen=True)
class ArchSpec:
    """How one model family stores its checkpoint and wires its block. Tensor names are templates over ``{i}``.

    Norm roles: ``input_norm`` feeds attention; without ``pre_feedforward_norm`` the
    ``post_attention_norm`` feeds the MLP (Llama). With it (Gemma 2/3), ``post_attention_norm`` normalizes
    the attention output before the residual add, ``pre_feedforward_norm`` feeds the MLP and
    ``post_feedforward_norm`` normalizes its output.
    """

    family: str
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
    pre_feedforward_norm: str | None = None
    post_feedforward_norm: str | None = None
    q_norm: str | None = None  # per-head RMSNorm of queries before rotary
    k_norm: str | None = None
    qkv_proj: str | None = None  # q, k, v stored as one [q; k; v] matrix, split at load time
    gate_up_proj: str | None = None  # gate and up stored as one [gate; up] matrix
    qkv_bias: bool | None = None  # q, k and v biases: None follows config["attention_bias"]
    o_bias: bool | None = None  # the output projection's bias: None follows config["attention_bias"]
    has_mlp_bias: bool = False  # whether config["mlp_bias"] is read at all
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma stores w around 0
    embed_scale: bool = False  # the embedding output is multiplied by sqrt(hidden) (Gemma)
    tied_by_default: bool = False  # tie_word_embeddings when config.json omits it (transformers' default)
    activation_key: str = "hidden_act"
    default_activation: str = "silu"
    window_rule: str = "none"  # which layers slide when config.json has no layer_types: see WINDOW_RULES
    window_period: int = 2  # "periodic": layer i slides unless (i + 1) is a multiple of this (or the config's)
    text_config: bool = False  # a multimodal config whose "text_config" describes the language model
    ignored_prefixes: tuple[str, ...] = ()  # tensors of other towers (vision) that the text model never reads
    wires: frozenset[str] = frozenset()  # config keys that change the math and that this family implements
    # mixture of experts (None: a dense MLP). Expert tensors are templates over {i} (layer) and {e} (expert).
    router: str | None = None  # the router's [experts, hidden] matrix (no bias), a prefix like the projections
    expert_gate: str | None = None
    expert_up: str | None = None
    expert_down: str | None = None
    experts_keys: tuple[str, ...] = ()  # config keys that may hold the expert count, first found wins
    expert_size_key: str = "intermediate_size"  # the config key of one expert's intermediate size
    dense_size_key: str = "intermediate_size"  # the config key of a dense layer's intermediate size
    # the config key saying whether the top-k routing weights are renormalized to sum to 1; None: always
    norm_topk_key: str | None = None
    norm_topk_default: bool = False  # its value where config.json omits it (transformers' default for the family)
    # a shared expert every token runs (Qwen2-MoE): a gated MLP's prefix over {i}, its sigmoid gate's [1, hidden]
    # weight prefix, and the config key of its intermediate size
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    shared_expert_size_key: str = "shared_expert_intermediate_size"
    # gpt-oss: every expert stored in 3-D tensors under this prefix over {i}: gate_up_proj [E, hidden, 2 * size]
    # (gate and up interleaved), down_proj [E, size, hidden], each with a bias; None: one 2-D matrix an expert
    stacked_experts: str | None = None
    # Llama 4's stacked experts: gate_up_proj [E, hidden, 2 * size] holds gate then up (halves, not interleaved), no
    # biases; the top-k router logits' sigmoids scale each chosen expert's input (not its output)
    stacked_halves: bool = False
    router_bias: bool = False  # the router has a bias
    topk_softmax: bool = False  # softmax over the top-k logits (gpt-oss), not top-k of a softmax over all
    sinks: str | None = None  # a learned attention-sink logit per head, a tensor over {i} (gpt-oss)
    dense_rule: str = "none"  # which layers of a MoE model are dense: see DENSE_RULES
    # GLM-4.5 / DeepSeek-V3 routing: sigmoid scores, a per-expert bias (this tensor over {i}) added to them for the
    # choice only, top-k within the best topk_group of n_group groups, weights scaled by routed_scaling_factor
    sigmoid_routing: bool = False
    router_correction: str | None = None
    # the shared expert's intermediate size is this config key times one expert's (GLM: n_shared_experts); None:
    # shared_expert_size_key holds it
    shared_expert_count_key: str | None = None
    qk_norm_key: str | None = None  # a config key that switches the q/k norms on (GLM: use_qk_norm); None: always
    # the config key of the multi-token-prediction layers a checkpoint stores after the last (never read)
    mtp_layers_key: str | None = None
    # multi-head latent attention (DeepSeek-V3), the prefix over {i} of its tensors: q_a_proj, q_a_layernorm,
    # q_b_proj (or q_proj without q_lora_rank), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; None: q/k/v
    mla: str | None = None

    @property
    def moe(self) -> bool:
        return self.router is not None

    @property
    def sandwich_norms(self) -> bool:
        return self.pre_feedforward_norm is not None

    def norm_templates(self) -> tuple[str, ...]:
        """Every per-layer RMSNorm scale tensor (templates over ``{i}``)."""
        found = (self.input_norm, self.post_attention_norm, self.pre_feedforward_norm, self.post_feedforward_norm,
                 self.q_norm, self.k_norm)
        return tuple(t + ("" if t.endswith(".weight") else ".weight") for t in found if t is not None)


class _Names(TypedDict, total=False):
    """ArchSpec's tensor-name fields, so a family entry can spread a shared naming scheme."""

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
    pre_feedforward_norm: str
    post_feedforward_norm: str
    q_norm: str
    k_norm: str


def _names(prefix: str = "model.", *, gemma: bool = False, qk_norm: bool = False,
           lm_head: str = "lm_head.weight") -> _Names:
    """A naming scheme: Llama's (``prefix`` + layers.{i}...), with Gemma's four norms and/or q/k norms."""
    layer = prefix + "layers.{i}."
    names = _Names(
        embed=prefix + "embed_tokens.weight", final_norm=prefix + "norm.weight", lm_head=lm_head,
        input_norm=layer + "input_layernorm.weight", post_attention_norm=layer + "post_attention_layernorm.weight",
        q_proj=layer + "self_attn.q_proj", k_proj=layer + "self_attn.k_proj", v_proj=layer + "self_attn.v_proj",
        o_proj=layer + "self_attn.o_proj", gate_proj=layer + "mlp.gate_proj", up_proj=layer + "mlp.up_proj",
        down_proj=layer + "mlp.down_proj",
    )
    if gemma:
        names["pre_feedforward_norm"] = layer + "pre_feedforward_layernorm.weight"
        names["post_feedforward_norm"] = layer + "post_feedforward_layernorm.weight"
    if qk_norm:
        names["q_norm"] = layer + "self_attn.q_norm.weight"
        names["k_norm"] = layer + "self_attn.k_norm.weight"
    return names


_SLIDING = frozenset({"sliding_window", "layer_types"})
_QWEN_SLIDING = _SLIDING | {"use_sliding_window", "max_window_layers"}
_QWEN_MOE = _QWEN_SLIDING | {"mlp_only_layers", "decoder_sparse_step"}
_GEMMA = _SLIDING | {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "hidden_activation", "sliding_window_pattern", "_sliding_window_pattern"}

LLAMA = ArchSpec(family="llama", model_types=("llama",), **_names(), has_mlp_bias=True)
QWEN2 = ArchSpec(family="qwen2", model_types=("qwen2",), **_names(), qkv_bias=True, o_bias=False,
                 window_rule="from_max_window_layers", wires=_QWEN_SLIDING)
QWEN3 = ArchSpec(family="qwen3", model_types=("qwen3",), **_names(qk_norm=True),
                 window_rule="from_max_window_layers", wires=_QWEN_SLIDING)
MISTRAL = ArchSpec(family="mistral", model_types=("mistral",), **_names(), qkv_bias=False, o_bias=False,
                   window_rule="all", wires=_SLIDING)
PHI3 = ArchSpec(
    family="phi3", model_types=("phi3",), **_names(), qkv_bias=False, o_bias=False,
    qkv_proj="model.layers.{i}.self_attn.qkv_proj", gate_up_proj="model.layers.{i}.mlp.gate_up_proj",
    window_rule="all", wires=_SLIDING | {"partial_rotary_factor", "original_max_position_embeddings"},
)
GEMMA2 = ArchSpec(family="gemma2", model_types=("gemma2",), **_names(gemma=True), norm_offset=1.0, embed_scale=True,
                  tied_by_default=True,
                  activation_key="hidden_activation", default_activation="gelu_pytorch_tanh", window_rule="periodic",
                  window_period=2, wires=_GEMMA)
GEMMA3_TEXT = replace(GEMMA2, family="gemma3_text", model_types=("gemma3_text",), **_names(gemma=True, qk_norm=True),
                      window_period=6,
                      wires=_GEMMA | {"rope_local_base_freq"})
GEMMA3 = replace(GEMMA3_TEXT, family="gemma3", model_types=("gemma3",),
                 **_names("language_model.model.", gemma=True, qk_norm=True, lm_head="language_model.lm_head.weight"),
                 text_config=True,
                 ignored_prefixes=("vision_tower.", "multi_modal_projector."))

QWEN3_MOE = replace(QWEN3, family="qwen3_moe", model_types=("qwen3_moe",),
                    router="model.layers.{i}.mlp.gate", expert_gate="model.layers.{i}.mlp.experts.{e}.gate_proj",
                    expert_up="model.layers.{i}.mlp.experts.{e}.up_proj",
                    expert_down="model.layers.{i}.mlp.experts.{e}.down_proj",
                    experts_keys=("num_experts", "num_local_experts"), expert_size_key="moe_intermediate_size",
                    norm_topk_key="norm_topk_prob", dense_rule="sparse_step", wires=_QWEN_MOE)
QWEN2_MOE = replace(QWEN3_MOE, family="qwen2_moe", model_types=("qwen2_moe",), q_norm=None, k_norm=None,
                    qkv_bias=True, o_bias=False, wires=_QWEN_MOE,
                    shared_expert="model.layers.{i}.mlp.shared_expert",
                    shared_expert_gate="model.layers.{i}.mlp.shared_expert_gate")
GPT_OSS = ArchSpec(
    family="gpt_oss", model_types=("gpt_oss",), **_names(), wires=_SLIDING | {"swiglu_alpha", "swiglu_limit"},
    router="model.layers.{i}.mlp.router", stacked_experts="model.layers.{i}.mlp.experts",
    experts_keys=("num_local_experts",), expert_size_key="intermediate_size", router_bias=True, topk_softmax=True,
    sinks="model.layers.{i}.self_attn.sinks",
)
MIXTRAL = replace(MISTRAL, family="mixtral", model_types=("mixtral",),
                  router="model.layers.{i}.block_sparse_moe.gate",
                  expert_gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1",
                  expert_up="model.layers.{i}.block_sparse_moe.experts.{e}.w3",
                  expert_down="model.layers.{i}.block_sparse_moe.experts.{e}.w2",
                  experts_keys=("num_local_experts",), expert_size_key="intermediate_size")

GLM4_MOE = ArchSpec(
    family="glm4_moe", model_types=("glm4_moe",), **_names(qk_norm=True), o_bias=False, qk_norm_key="use_qk_norm",
    router="model.layers.{i}.mlp.gate", router_correction="model.layers.{i}.mlp.gate.e_score_correction_bias",
    expert_gate="model.layers.{i}.mlp.experts.{e}.gate_proj", expert_up="model.layers.{i}.mlp.experts.{e}.up_proj",
    expert_down="model.layers.{i}.mlp.experts.{e}.down_proj", experts_keys=("n_routed_experts", "num_local_experts"),
    expert_size_key="moe_intermediate_size", norm_topk_key="norm_topk_prob", norm_topk_default=True,
    shared_expert="model.layers.{i}.mlp.shared_experts", shared_expert_count_key="n_shared_experts",
    sigmoid_routing=True, dense_rule="first_k", mtp_layers_key="num_nextn_predict_layers",
    wires=frozenset({"partial_rotary_factor", "use_qk_norm", "first_k_dense_replace", "n_group", "topk_group",
                     "routed_scaling_factor", "n_shared_experts"}),
)
# DeepSeek-V3 (and Moonlight, Kimi K2): GLM-4.5's routing, experts and leading dense layers, with multi-head latent
# attention; its q/k norms are MLA's latent norms (no per-head q_norm/k_norm)
DEEPSEEK_V3 = replace(
    GLM4_MOE, family="deepseek_v3", model_types=("deepseek_v3",), q_norm=None, k_norm=None, qk_norm_key=None,
    qkv_bias=None, o_bias=None, mla="model.layers.{i}.self_attn",
    wires=frozenset({"first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
                     "rope_interleave"}),
)
# Llama 4: chunked local attention on its rotary layers, global attention without rotary (temperature-tuned) on the
# others, q/k L2 norms after the (interleaved-pair) rotary, interleaved MoE layers of stacked experts with a shared one
def _llama4(family: str, prefix: str = "model.", lm_head: str = "lm_head.weight", **extra: Any) -> ArchSpec:
    ff = prefix + "layers.{i}.feed_forward."
    names = _names(prefix, lm_head=lm_head) | _Names(gate_proj=ff + "gate_proj", up_proj=ff + "up_proj",
                                                     down_proj=ff + "down_proj")
    return ArchSpec(family=family, model_types=(family,), **names, router=ff + "router",
                    stacked_experts=ff + "experts", stacked_halves=True, experts_keys=("num_local_experts",),
                    dense_size_key="intermediate_size_mlp", shared_expert=ff + "shared_expert",
                    shared_expert_size_key="intermediate_size", dense_rule="moe_layers",
                    wires=frozenset({"attention_chunk_size", "no_rope_layers", "use_qk_norm", "layer_types"}),
                    **extra)


LLAMA4_TEXT = _llama4("llama4_text")
LLAMA4 = _llama4("llama4", "language_model.model.", "language_model.lm_head.weight", text_config=True,
                 ignored_prefixes=("vision_model.", "multi_modal_projector."))
MOE_TYPES = ("deepseek_v3", "glm4_moe", "gpt_oss", "llama4", "llama4_text", "mixtral", "qwen2_moe", "qwen3_moe")  # named in the refusal of other MoE types

FAMILIES = (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA2, GEMMA3_TEXT, GEMMA3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, GPT_OSS,
            GLM4_MOE, DEEPSEEK_V3, LLAMA4_TEXT, LLAMA4)
ARCHITECTURES: dict[str, ArchSpec] = {t: spec for spec in FAMILIES for t in spec.model_types}


def arch_for(config: dict[str, Any]) -> ArchSpec:
    """The family of a config.json's ``model_type``; refuses (naming the supported ones) a family not in the table."""
    model_type = str(config.get("model_type"))
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        if model_type in UNSUPPORTED_MOE or any(k in config for k in ("num_experts", "num_local_experts",
                                                                      "n_routed_experts")):
            needs = UNSUPPORTED_MOE.get(model_type, "its routing and expert layout described as a family")
            raise UnsupportedArchitectureError(
                f"config.json has model_type={model_type!r}, a mixture-of-experts (MoE) model ovshard does not "
                f"compile yet: it would need {needs}. Supported: {supported} (MoE: {', '.join(MOE_TYPES)})."
            )
        raise UnsupportedArchitectureError(
            f"config.json has model_type={model_type!r}; ovshard supports: {supported}. A new family needs an "
            "ArchSpec entry in ovshard/frontend/arch.py (tensor names, norm layout, the config keys it wires) "
            "and a family test in tests/compiler/test_families.py; see docs/families.md, 'Adding a family'."
        )
    return spec


def activation(spec: ArchSpec, config: dict[str, Any]) -> str:
    """The block's activation ("silu", "gelu_tanh", "gelu"), from the family's config key."""
    name = config.get(spec.activation_key) or config.get("hidden_act") or spec.default_activation
    if name not in ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"{spec.activation_key}={name!r} is not supported for {spec.family}; expected one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def rope_settings(config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters (of one layer type, where they differ per type).

    Reads transformers 5 ``rope_parameters`` (flat, or one dict per layer type as Gemma 3 writes) and the
    legacy keys: ``rope_scaling``, ``rope_theta`` and Gemma 3's ``rope_local_base_freq``.
    """
    params = dict(config.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get(layer_type or "full_attention") or next(iter(params.values())))
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in config:  # legacy Gemma 3
        params = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    legacy = config.get("rope_scaling") or {}
    if layer_type != "sliding_attention" or "rope_local_base_freq" not in config:
        for key, value in legacy.items():
            params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def read_dims(spec: ArchSpec, config: dict[str, Any]) -> ModelDims:
    """The dimensions of a ``spec`` model whose language model's config is ``config`` (``description.language_config``)."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        attention_bias = bool(config.get("attention_bias", False))
        rope = rope_settings(config)
        fields: dict[str, Any] = dict(
            model_type=str(config["model_type"]) if not spec.text_config else spec.model_types[0],
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config[spec.dense_size_key]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", spec.tied_by_default)),
            attention_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) and spec.has_mlp_bias,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_type=str(rope["rope_type"]),
            rope_theta=float(rope["rope_theta"]),
            o_bias=attention_bias if spec.o_bias is None else spec.o_bias,
            attention_softcap=_optional_float(config.get("attn_logit_softcapping")),
            attention_sinks=spec.sinks is not None,
            qk_norm=spec.q_norm is not None and (spec.qk_norm_key is None or bool(config.get(spec.qk_norm_key))),
            **_expert_dims(spec, config),
        )
        dims = ModelDims(**(fields | _mla_dims(spec, config, heads)))
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}, which a {spec.family} model needs") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json has a malformed value ({e}); check it against the model's card") from e
    if dims.num_heads % dims.num_kv_heads:
        raise CheckpointError(
            f"num_attention_heads={dims.num_heads} is not a multiple of num_key_value_heads={dims.num_kv_heads}"
        )
    return dims


def _expert_dims(spec: ArchSpec, config: dict[str, Any]) -> dict[str, Any]:
    """num_experts, experts_per_token and expert_size of a MoE family's config (nothing for a dense one)."""
    if not spec.moe:
        return {}
    count = next((config[k] for k in spec.experts_keys if config.get(k) is not None), None)
    if count is None:
        raise KeyError(spec.experts_keys[0])
    experts, per_token = int(count), int(config["num_experts_per_tok"])
    if not 0 < per_token <= experts:
        raise CheckpointError(f"num_experts_per_tok={per_token} must be between 1 and the {experts} experts")
    size = int(config[spec.expert_size_key])
    shared = 0
    if spec.shared_expert and spec.shared_expert_count_key:
        shared = size * int(config.get(spec.shared_expert_count_key) or 0)
    elif spec.shared_expert:
        shared = int(config[spec.shared_expert_size_key])
    return {"num_experts": experts, "experts_per_token": per_token, "expert_size": size,
            "shared_expert_size": shared,
            "expert_projections": 2 if spec.stacked_experts and not spec.stacked_halves else 3,
            "expert_input_scores": spec.stacked_halves,
            "dense_layers": dense_layers(spec, config, int(config["num_hidden_layers"]))}


def _mla_dims(spec: ArchSpec, config: dict[str, Any], heads: int) -> dict[str, Any]:
    """Multi-head latent attention's numbers (nothing for other families): a key head is qk_nope_head_dim +
    qk_rope_head_dim wide, a value head v_head_dim; every head has its own key and value, which the latent cache
    holds as the latent and the rotary key they come from (frontend/mla.py)."""
    if not spec.mla:
        return {}
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if kv_heads != heads:  # kv_b_proj expands the latent into one key and value per query head
        raise CheckpointError(f"config.json has num_key_value_heads={kv_heads} for {heads} attention heads; "
                              "multi-head latent attention expands a key and a value per head: expected them equal")
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    return {"head_dim": nope + rope, "num_kv_heads": heads, "kv_lora_rank": int(config["kv_lora_rank"]),
            "q_lora_rank": int(config.get("q_lora_rank") or 0), "rope_head_dim": rope,
            "value_head_dim": int(config["v_head_dim"]), "latent_cache": True}


def dense_layers(spec: ArchSpec, config: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The layers of a MoE model whose MLP is dense, by the family's rule (DENSE_RULES), as transformers builds them."""
    if spec.dense_rule == "first_k":
        return tuple(range(min(int(config.get("first_k_dense_replace") or 0), layers)))
    if spec.dense_rule == "moe_layers":
        step = int(config.get("interleave_moe_layer_step") or 1)
        listed = config.get("moe_layers")
        sparse = range(step - 1, layers, step) if listed is None else listed
        if not isinstance(sparse, (list, range)) or step < 1:
            raise CheckpointError(f"config.json has moe_layers={listed!r}, interleave_moe_layer_step={step!r}; "
                                  "expected a list of layer indices and a step of 1 or more")
        return tuple(i for i in range(layers) if i not in sparse)
    if spec.dense_rule == "sparse_step":
        listed = config.get("mlp_only_layers") or []
        step = int(config.get("decoder_sparse_step") or 1)
        if not isinstance(listed, list) or step < 1:
            raise CheckpointError(f"config.json has mlp_only_layers={listed!r}, decoder_sparse_step={step!r}; "
                                  "expected a list of layer indices and a step of 1 or more")
        return tuple(i for i in range(layers) if i in listed or (i + 1) % step)
    return ()


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
