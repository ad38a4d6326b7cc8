"""GGUF metadata as the config.json and generation_config.json transformers rebuilds from it.

One table, :data:`FAMILIES`, says per GGUF architecture which Hugging Face ``model_type`` it loads as
and what llama.cpp's converter did to its tensors. The config keys follow transformers' GGUF loader
(``transformers.integrations.ggml.GGUF_CONFIG_MAPPING`` and the config classes' defaults), and where the
file states more than transformers reads, llama.cpp (which computes with it): a stored head size
(``attention.key_length``), rope scaling keys, Llama 3's ``rope_freqs`` table, Gemma's 27B query scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ovshard.errors import CheckpointError, UnsupportedArchitectureError
from ovshard.frontend.block import FULL, SLIDING


@dataclass(frozen=True)
class ExpertKeys:
    """How a mixture-of-experts family's config names its experts, and how llama.cpp routes them."""

    count: str = "num_experts"  # the config key of the expert count (llama.cpp's expert_count)
    # the config key of one expert's width, read from expert_feed_forward_length; None: the file stores no such
    # key and feed_forward_length (intermediate_size) is the expert width (Mixtral)
    size: str | None = "moe_intermediate_size"
    # norm_topk_prob as llama.cpp computes (it renormalizes the top-k weights per architecture; the file does
    # not say); None: the config has no such key, the family fixes it (Mixtral always renormalizes)
    norm_topk: bool | None = True
    # DeepSeek-V3's routing (GLM-4.5's too), every choice stated in the file: sigmoid scores (expert_gating_func),
    # top-k within the best expert_group_used_count of expert_group_count groups, weights renormalized
    # (expert_weights_norm) and scaled (expert_weights_scale), expert_shared_count shared experts of the expert
    # width, the first leading_dense_block_count layers dense
    grouped: bool = False
    softmax_unless_stated: bool = False  # llama.cpp's reading of a file without expert_gating_func (DeepSeek-V2's)


@dataclass(frozen=True)
class GGUFFamily:
    """What one GGUF architecture loads as, and what llama.cpp's converter did to its tensors."""

    model_type: str  # the Hugging Face model_type
    permute_qk: bool = False  # q/k rows permuted into llama.cpp's rotary layout
    norm_offset: bool = False  # RMSNorm scales stored as 1 + w
    activation: tuple[str, str] = ("hidden_act", "silu")  # the config key and value transformers sets
    sliding_period: int | None = None  # every period-th layer attends fully, the others slide
    large_layers: int | None = None  # the 27B's layer count: llama.cpp scales its queries by hidden/heads
    local_rope_theta: float | None = None  # the sliding layers' rope base, which the file does not store
    softcaps: tuple[float | None, float | None] = (None, None)  # attention, final logits: when not stored
    experts: ExpertKeys | None = None  # a mixture of experts: stored stacked, one [E, out, in] tensor a projection
    partial_rotary: bool = False  # rope.dimension_count may be less than the head: read as partial_rotary_factor
    qk_norm_key: str | None = None  # the config key saying whether per-head q/k norms exist (attn_q_norm is stored)
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3): its ranks and head widths read from the file
    dense_size: str = "intermediate_size"  # the config key of feed_forward_length (Llama 4's dense layers' width)
    # Llama 4: the interleaved MoE layers (interleave_moe_layer_step); llama.cpp fixes the rest (chunks of 8192, every
    # 4th layer NoPE, attention temperature 8192 and 0.1: transformers' defaults) and q/k norms unless 128 experts
    llama4: bool = False
    fixed: tuple[tuple[str, Any], ...] = ()  # config keys llama.cpp fixes for the architecture, the file stores none
    # transformers' tokenizer class for the vocabulary, named where AutoTokenizer would read the file's config
    # first to pick one and fails (transformers 5 on gpt-oss's yarn keys); None: AutoTokenizer picks
    tokenizer_class: str | None = None


_GELU = ("hidden_activation", "gelu_pytorch_tanh")
FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", permute_qk=True),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3"),
    "qwen2moe": GGUFFamily("qwen2_moe", experts=ExpertKeys(norm_topk=False)),
    "qwen3moe": GGUFFamily("qwen3_moe", experts=ExpertKeys()),
    # GLM-4.5: partial rotary (rope.dimension_count of each head), and the next-token-prediction layers that
    # convert_hf_to_gguf.py appends after the model's (nextn_predict_layers), which are not read
    "glm4moe": GGUFFamily("glm4_moe", experts=ExpertKeys("n_routed_experts", norm_topk=None, grouped=True),
                          partial_rotary=True, qk_norm_key="use_qk_norm"),
    # DeepSeek-V3 (and Kimi K2, Moonlight): multi-head latent attention, which llama.cpp rotates in interleaved
    # pairs whatever the source's rope_interleave; GLM-4.5's routing (DeepSeek-V2's softmax routing is refused)
    "deepseek2": GGUFFamily("deepseek_v3", experts=ExpertKeys("n_routed_experts", norm_topk=None, grouped=True,
                                                              softmax_unless_stated=True),
                            mla=True, fixed=(("rope_interleave", True),)),
    "llama4": GGUFFamily("llama4_text", experts=ExpertKeys("num_local_experts", "intermediate_size", None),
                         dense_size="intermediate_size_mlp", llama4=True),
    "gemma2": GGUFFamily("gemma2", norm_offset=True, activation=_GELU, sliding_period=2, large_layers=46,
                         softcaps=(50.0, 30.0)),
    "gemma3": GGUFFamily("gemma3_text", norm_offset=True, activation=_GELU, sliding_period=6, large_layers=62,
                         local_rope_theta=10000.0),
    # llama.cpp runs gpt-oss's clamped SwiGLU with gpt-oss's constants; its yarn rope rounds the correction
    # range to whole dimensions (transformers' truncate, its default when the config does not say)
    "gpt-oss": GGUFFamily("gpt_oss", sliding_period=2, experts=ExpertKeys("num_local_experts", "intermediate_size", None),
                          fixed=(("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)), tokenizer_class="TokenizersBackend"),
}
# llama.cpp writes Mistral and Mistral-Nemo as "llama" and runs them as llama (no sliding window); they load
# as llama here too, as in transformers (which renames only a file whose general.name is exactly "mistral")

# architectures llama.cpp also writes mixture-of-experts models as (the file sets {arch}.expert_count): Mixtral
# is "llama" with its experts stacked; llama.cpp runs it as llama (no sliding window), with renormalized top-k
# weights as Mixtral's own, and its feed_forward_length is the expert width
EXPERT_VARIANTS: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("mixtral", permute_qk=True, experts=ExpertKeys("num_local_experts", None, None)),
}


def family_of(path: Path, arch: str, meta: dict[str, Any]) -> GGUFFamily:
    if arch not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{path} is a GGUF of architecture {arch!r}; ovshard reads GGUF architectures "
            f"{', '.join(sorted(FAMILIES))} (llama with experts as Mixtral). Start from the model's safetensors "
            "checkpoint instead.")
    if meta.get(f"{arch}.expert_count") and arch in EXPERT_VARIANTS:
        return EXPERT_VARIANTS[arch]
    return FAMILIES[arch]


def rebuild_config(path: Path, arch: str, family: GGUFFamily, meta: dict[str, Any],
                   shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The config.json transformers builds from this file's metadata (transformers 5 names).

    ``shapes``: every GGUF tensor's (torch-order) shape; ``rope_freqs``: the file's rope_freqs table, if any.
    """

    def key(name: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise CheckpointError(f"{path} lacks the metadata key {arch}.{name}, which a {arch} GGUF needs; "
                                  "convert the model again with a current llama.cpp")
        return value

    if key("expert_count", None) and not family.experts:
        raise UnsupportedArchitectureError(
            f"{path} is a mixture-of-experts (MoE) model ({key('expert_count')} experts) of GGUF architecture "
            f"{arch!r}; ovshard reads MoE GGUF files of architectures {', '.join(_moe_architectures())} only. "
            "Start from the safetensors checkpoint.")
    hidden, heads, blocks = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    mtp = int(key("nextn_predict_layers", 0))  # next-token-prediction blocks appended after the model's, not read
    layers = blocks - mtp
    if not 0 <= mtp < blocks:
        raise CheckpointError(f"{path} states {mtp} next-token-prediction layers of its {blocks} blocks; expected "
                              "fewer than the blocks: the file is corrupt, convert the model again")
    rope_dim = key("rope.dimension_count", None)
    if family.partial_rotary:  # the rotary part of a head is not its width: the q rows say the width
        head_dim = int(key("attention.key_length", None) or shapes.get("blk.0.attn_q.weight", (hidden,))[0] // heads)
    else:
        head_dim = int(key("attention.key_length", None) or rope_dim or hidden // heads)
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # llama.cpp writes one count a layer for hybrid models
        if len(set(kv_heads)) != 1:
            raise UnsupportedArchitectureError(f"{path} has per-layer key/value head counts {kv_heads}; "
                                               "ovshard needs one count for every layer")
        kv_heads = kv_heads[0]
    act_key, act = family.activation
    config: dict[str, Any] = {
        "model_type": family.model_type, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
        family.dense_size: int(key("feed_forward_length")), "vocab_size": shapes.get("token_embd.weight", (0,))[0],
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")), act_key: act,
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": any(f"blk.0.{n}.bias" in shapes for n in ("attn_q", "attn_q_a", "attn_kv_a_mqa")),
        "rope_parameters": _rope(path, arch, family, meta, rope_freqs, head_dim),
    }
    if family.experts is not None:
        config |= _experts(path, family.experts, key)
    if family.partial_rotary and rope_dim is not None:  # stated even when 1: GLM's config defaults to 0.5
        config["rope_parameters"]["partial_rotary_factor"] = int(rope_dim) / head_dim  # transformers 5 keeps it there
    if family.qk_norm_key is not None:
        config[family.qk_norm_key] = "blk.0.attn_q_norm.weight" in shapes
    if mtp:
        config["num_nextn_predict_layers"] = mtp
    if family.llama4:
        config |= _llama4(path, key)
    if family.mla:
        config |= _mla(key, heads)
        config["rope_parameters"] |= _yarn_mscale(arch, meta, config["rope_parameters"])
    for name, ggml_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        if f"tokenizer.ggml.{ggml_key}" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{ggml_key}"])
    config |= dict(family.fixed)
    if family.sliding_period is not None:
        period = family.sliding_period
        config["sliding_window"] = int(key("attention.sliding_window"))
        config["layer_types"] = [SLIDING if (i + 1) % period else FULL for i in range(layers)]
    if family.large_layers is not None:  # Gemma's query scale and soft-caps
        config["query_pre_attn_scalar"] = hidden // heads if layers == family.large_layers else head_dim
        attn_cap, final_cap = family.softcaps
        config["attn_logit_softcapping"] = key("attn_logit_softcapping", attn_cap)
        config["final_logit_softcapping"] = key("final_logit_softcapping", final_cap)
    return config


def _experts(path: Path, keys: ExpertKeys, key: Any) -> dict[str, Any]:
    """The expert count, top-k, width and routing keys of a mixture-of-experts config (``key`` reads metadata)."""
    config = {keys.count: int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count"))}
    if keys.size is not None:
        config[keys.size] = int(key("expert_feed_forward_length"))
    if keys.norm_topk is not None:  # whether the top-k weights are renormalized is llama.cpp's per architecture
        config["norm_topk_prob"] = keys.norm_topk
    if keys.grouped:
        return config | _grouped_routing(path, key, SOFTMAX_GATING if keys.softmax_unless_stated else SIGMOID_GATING)
    if key("expert_shared_feed_forward_length", None):
        config["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return config


SOFTMAX_GATING, SIGMOID_GATING = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def _grouped_routing(path: Path, key: Any, unstated: int) -> dict[str, Any]:
    """DeepSeek-V3's routing keys (GLM-4.5's too) as their config names them, with llama.cpp's defaults where the
    file states nothing: no groups, no leading dense layers, the top-k weights not renormalized, and ``unstated``'s
    gating."""
    gating = int(key("expert_gating_func", unstated))
    if gating != SIGMOID_GATING:
        raise UnsupportedArchitectureError(
            f"{path} routes its experts by expert_gating_func={gating} (1: softmax, DeepSeek-V2's, which a file "
            "without the key means too); ovshard reads "
            f"this architecture's sigmoid routing only ({SIGMOID_GATING}). Start from the safetensors checkpoint.")
    return {"n_shared_experts": int(key("expert_shared_count")),
            "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
            "n_group": int(key("expert_group_count", 1)), "topk_group": int(key("expert_group_used_count", 1)),
            "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(key("expert_weights_norm", False))}


LLAMA4_NO_QK_NORM_EXPERTS = 128  # llama.cpp runs Llama 4 Maverick (128 experts) without q/k norms, as its config says


def _llama4(path: Path, key: Any) -> dict[str, Any]:
    """Llama 4's config keys that the file states, or llama.cpp derives from it."""
    if key("attention.sliding_window", None) == 0:
        raise UnsupportedArchitectureError(
            f"{path} is a llama4 file without chunked attention (attention.sliding_window 0: MobileLLM's), which "
            "ovshard does not read from GGUF; start from the safetensors checkpoint")
    return {"interleave_moe_layer_step": int(key("interleave_moe_layer_step")),
            "use_qk_norm": int(key("expert_count")) != LLAMA4_NO_QK_NORM_EXPERTS}


def _mla(key: Any, heads: int) -> dict[str, Any]:
    """Multi-head latent attention's config keys. Current llama.cpp writes it as one key/value head of the latent
    (key_length kv_lora_rank + rope, value_length kv_lora_rank) and the per-head widths as key_length_mla and
    value_length_mla; files from before (an attn_kv_b tensor) state the per-head widths as key/value_length."""
    rope = int(key("rope.dimension_count"))
    width = int(key("attention.key_length_mla", None) or key("attention.key_length"))
    q_rank = key("attention.q_lora_rank", None)
    return {"num_key_value_heads": heads, "head_dim": rope, "qk_rope_head_dim": rope, "qk_nope_head_dim": width - rope,
            "qk_head_dim": width, "v_head_dim": int(key("attention.value_length_mla", None) or key("attention.value_length")),
            "kv_lora_rank": int(key("attention.kv_lora_rank")), "q_lora_rank": None if q_rank is None else int(q_rank)}


def _yarn_mscale(arch: str, meta: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's yarn attention scale: llama.cpp stores 0.1 * mscale_all_dim as rope.scaling.yarn_log_multiplier
    (an f32, rounded back here), scales the scores by (1 + that * ln(factor))^2 and rotates without yarn's magnitude
    factor, as transformers does with mscale == mscale_all_dim."""
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if rope["rope_type"] != "yarn" or log_mul is None:
        return {}
    mscale = round(float(log_mul) / 0.1, 6)
    return {"mscale": mscale, "mscale_all_dim": mscale}


def _moe_architectures() -> list[str]:
    """The MoE GGUF architectures read, for messages: "qwen3moe", "llama (Mixtral)" ..."""
    return sorted([a for a, f in FAMILIES.items() if f.experts] + [f"{a} ({f.model_type})" for a, f in
                                                                   EXPERT_VARIANTS.items()])


def _rope(path: Path, arch: str, family: GGUFFamily, meta: dict[str, Any], rope_freqs: np.ndarray | None,
          head_dim: int) -> dict[str, Any]:
    """``rope_parameters``: the base, llama.cpp's scaling keys, Llama 3's ``rope_freqs`` table, Gemma 3's local base.

    transformers reads the base only; a file that says more is followed (llama.cpp computes with it).
    """
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor not in (None, 1.0):
        params.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=float(factor or 1.0), original_max_position_embeddings=int(
            meta[f"{arch}.rope.scaling.original_context_length"]))
        for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):  # llama.cpp's defaults (and transformers')
            params[name] = float(meta.get(f"{arch}.rope.scaling.yarn_{name}", default))
    elif scaling not in ("none", "linear"):
        raise UnsupportedArchitectureError(f"{path} sets {arch}.rope.scaling.type={scaling!r}; ovshard reads "
                                           "'none', 'linear' and 'yarn'")
    if rope_freqs is not None:
        params = _llama3_rope(path, rope_freqs, theta, head_dim)
    if family.local_rope_theta is None:
        return params
    local = {"rope_type": "default", "rope_theta": family.local_rope_theta}
    return {"sliding_attention": local, "full_attention": params}


# The Llama 3.1/3.2/3.3 rope settings; llama.cpp stores their effect as a table of per-frequency factors
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_rope(path: Path, table: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 rope parameters whose factors equal the file's ``rope_freqs`` table, or a refusal."""
    stored = np.asarray(table, dtype=np.float64)
    factor = float(stored.max())
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **LLAMA3_ROPE}
    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    context, low, high = (LLAMA3_ROPE[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                    "high_freq_factor"))
    smooth = (context / wavelength - low) / (high - low)
    expected = np.where(wavelength < context / high, 1.0,
                        np.where(wavelength > context / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-5):
        raise UnsupportedArchitectureError(
            f"{path} holds a rope_freqs table ({stored.size} factors) that the Llama 3 rope settings {LLAMA3_ROPE} "
            "do not reproduce; start from the model's safetensors checkpoint")
    return params


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: bos, pad, and every end-of-generation id the file names (eos, end of turn)."""
    eos = [int(meta[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in meta]
    eos = list(dict.fromkeys(eos))
    generation: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos} if eos else {}
    for name, k in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{k}" in meta:
            generation[name] = int(meta[f"tokenizer.ggml.{k}"])
    return generation


