"""Named model shapes for ``ovshard synth``: complete transformers-5 config.json dicts, one a preset.

Each family has a tiny default (the keys ``<Family>Config().to_dict()`` writes, minus the generic
``PretrainedConfig`` ones, with a small shape and ``initializer_range`` 0.1 for clear greedy margins);
a preset is that default with the public model's values. Values are those of the public config.json
files on the Hugging Face hub, written the way transformers 5 saves them (``rope_parameters``, per
layer type for Gemma 3; ``layer_types``), down to the ``dtype`` the weights are published in, which
``ovshard synth`` stores unless told otherwise (the tiny defaults are float32).
"""

from __future__ import annotations

import copy
from typing import Any

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
BF16 = "bfloat16"  # the dtype most public checkpoints are published in


def _common(architecture: str, model_type: str) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "dtype": "float32",
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.1,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 256,
    }


def _qwen(architecture: str, model_type: str) -> dict[str, Any]:
    return {**_common(architecture, model_type), "layer_types": [FULL] * 4, "max_window_layers": 4,
            "sliding_window": None, "use_sliding_window": False}


def _gemma(architecture: str, model_type: str) -> dict[str, Any]:
    config = _common(architecture, model_type)
    del config["hidden_act"]  # Gemma configs name it hidden_activation
    return {**config, "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
            "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
            "sliding_window": 8, "tie_word_embeddings": True, "use_bidirectional_attention": None}


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_common("LlamaForCausalLM", "llama"), "attention_bias": False, "head_dim": 16, "mlp_bias": False,
        "pretraining_tp": 1, "rms_norm_eps": 1e-5,
        # llama3 scaling with a short original context, so the scaled and unscaled bands both occur
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "qwen2": _qwen("Qwen2ForCausalLM", "qwen2"),  # q, k and v always carry biases: no attention_bias key
    "qwen3": {**_qwen("Qwen3ForCausalLM", "qwen3"), "attention_bias": False, "head_dim": 16},
    "mistral": {**_common("MistralForCausalLM", "mistral"), "head_dim": 16, "sliding_window": None},
    "phi3": {
        **_common("Phi3ForCausalLM", "phi3"), "embd_pdrop": 0.0, "original_max_position_embeddings": 512,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-5, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
    "gemma2": {**_gemma("Gemma2ForCausalLM", "gemma2"), "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "layer_types": [SLIDING, FULL] * 2},
    "gemma3_text": {**_gemma("Gemma3ForCausalLM", "gemma3_text"), "_sliding_window_pattern": 2,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "layer_types": [SLIDING, FULL] * 2, "use_bidirectional_attention": False,
                    "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                        FULL: {"rope_type": "default", "rope_theta": 1000000.0}}},
    "qwen3_moe": {**_qwen("Qwen3MoeForCausalLM", "qwen3_moe"), "attention_bias": False, "head_dim": 16,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": False,
                  "router_aux_loss_coef": 0.001},
    "gpt_oss": {**_common("GptOssForCausalLM", "gpt_oss"), "attention_bias": True, "head_dim": 16,
                "layer_types": [SLIDING, FULL] * 2, "num_experts_per_tok": 2, "num_local_experts": 4,
                "output_router_logits": False, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.9, "sliding_window": 8,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
    "glm4_moe": {**_common("Glm4MoeForCausalLM", "glm4_moe"), "attention_bias": True, "first_k_dense_replace": 1,
                 "head_dim": 16, "moe_intermediate_size": 32, "n_group": 1, "n_routed_experts": 8,
                 "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 2,
                 "num_nextn_predict_layers": 0, "output_router_logits": False, "routed_scaling_factor": 1.0,
                 "topk_group": 1, "use_qk_norm": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # multi-head latent attention: q through a 32-wide latent, keys and values from a 16-wide one plus an 8-wide
    # rotary key; a key head 16 + 8 wide, a value head 16; layer 0 dense, 8 experts in 2 groups (top-2 in the best 1)
    "deepseek_v3": {**_common("DeepseekV3ForCausalLM", "deepseek_v3"), "attention_bias": False,
                    "first_k_dense_replace": 1, "head_dim": 8, "kv_lora_rank": 16, "moe_intermediate_size": 32,
                    "n_group": 2, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
                    "num_experts_per_tok": 2, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
                    "output_router_logits": False, "pretraining_tp": 1, "q_lora_rank": 32, "qk_head_dim": 24,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rope_interleave": True,
                    "routed_scaling_factor": 2.5, "topk_group": 1, "v_head_dim": 16, "bos_token_id": 0,
                    "eos_token_id": 1},
    # Llama 4: chunks of 8 on the rotary layers 0 and 2, NoPE layers 1 and 3 (temperature tuned every 8 positions),
    # layers 1 and 3 sparse (4 stacked experts of 32, top-1, a shared expert), layers 0 and 2 dense of 128
    "llama4_text": {**_common("Llama4ForCausalLM", "llama4_text"), "attention_bias": False, "attention_chunk_size": 8,
                    "attn_scale": 0.1, "attn_temperature_tuning": True, "floor_scale": 8, "head_dim": 16,
                    "interleave_moe_layer_step": 2, "intermediate_size": 32, "intermediate_size_mlp": 128,
                    "layer_types": [CHUNKED, FULL] * 2, "moe_layers": [1, 3], "no_rope_layer_interval": 2,
                    "no_rope_layers": [1, 0] * 2, "num_experts_per_tok": 1, "num_local_experts": 4,
                    "output_router_logits": False, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.001,
                    "router_jitter_noise": 0.0, "use_qk_norm": True},
    "mixtral": {**_common("MixtralForCausalLM", "mixtral"), "head_dim": 16, "num_experts_per_tok": 2,
                "num_local_experts": 4, "output_router_logits": False, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0, "sliding_window": None},
}


def family_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A complete transformers-5 config.json dict of ``model_type``'s tiny shape, with ``overrides``.

    Each override replaces its key whole (``rope_parameters`` is replaced, not merged). ``layer_types``
    follows ``num_hidden_layers`` unless given: its pattern (the shortest period of the default) is
    repeated or cut to the layer count.
    """
    if model_type not in FAMILY_DEFAULTS:
        raise ValueError(f"no tiny default for model_type {model_type!r}; choose one of {', '.join(FAMILY_DEFAULTS)}")
    config = copy.deepcopy(FAMILY_DEFAULTS[model_type])
    config.update(copy.deepcopy(overrides))
    if "layer_types" in config and "layer_types" not in overrides:
        config["layer_types"] = resize_layer_types(config["layer_types"], config["num_hidden_layers"])
    return config


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A complete transformers-5 ``LlamaForCausalLM`` config.json dict (the tiny shape) with overrides."""
    return family_config("llama", **overrides)


def resize_layer_types(layer_types: list[str], layers: int) -> list[str]:
    """``layer_types`` for ``layers`` layers: the first ``layers`` entries of its periodic extension.

    The period is the shortest ``p`` with ``layer_types[i] == layer_types[i % p]`` for every listed layer
    (Gemma 2: 2, Gemma 3: 6, all-full: 1), so ``--layers`` keeps a model's sliding/full pattern.
    """
    period = next(p for p in range(1, len(layer_types) + 1)
                  if all(t == layer_types[i % p] for i, t in enumerate(layer_types)))
    return [layer_types[i % period] for i in range(layers)]


def _pattern(layers: int, period: int) -> list[str]:
    """Layer i is full attention when (i + 1) is a multiple of ``period``, else sliding (Gemma 2/3)."""
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(layers)]


def _qwen25(**values: Any) -> dict[str, Any]:
    layers = values["num_hidden_layers"]
    return family_config("qwen2", bos_token_id=151643, dtype=BF16, eos_token_id=151643, initializer_range=0.02,
                         layer_types=[FULL] * layers, max_window_layers=layers, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **values)


def _qwen3(**values: Any) -> dict[str, Any]:
    layers = values["num_hidden_layers"]
    return family_config("qwen3", bos_token_id=151643, dtype=BF16, eos_token_id=151645, head_dim=128,
                         initializer_range=0.02,
                         layer_types=[FULL] * layers, max_position_embeddings=40960, max_window_layers=layers,
                         num_key_value_heads=8, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         vocab_size=151936, **values)


def _gemma2(**values: Any) -> dict[str, Any]:  # the Gemma 2 base models are published in float32
    return family_config("gemma2", dtype="float32", head_dim=256, initializer_range=0.02,
                         layer_types=_pattern(values["num_hidden_layers"], 2), max_position_embeddings=8192,
                         query_pre_attn_scalar=256, sliding_window=4096, vocab_size=256000, **values)


def _gemma3(*, full_rope: dict[str, Any], **values: Any) -> dict[str, Any]:
    return family_config(
        "gemma3_text", _sliding_window_pattern=6, dtype=BF16, head_dim=256, initializer_range=0.02,
        layer_types=_pattern(values["num_hidden_layers"], 6), query_pre_attn_scalar=256,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {**full_rope, "rope_theta": 1000000.0}}, **values)


def _llama3_rope(theta: float, factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


_META_LLAMA3 = {"bos_token_id": 128000, "dtype": BF16, "eos_token_id": 128001, "initializer_range": 0.02,
                "max_position_embeddings": 131072, "num_key_value_heads": 8, "vocab_size": 128256}

# Phi-4-mini's longrope factors: one per rotary frequency (rotary_dim / 2 = 128 * 0.75 / 2 = 48)
_PHI4_LONG_FACTOR = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 31.03, 32.1, 32.13, 32.23,
    32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": llama_config(),
    "llama-3.2-1b": llama_config(
        **_META_LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
        intermediate_size=8192, tie_word_embeddings=True, rope_parameters=_llama3_rope(500000.0, 32.0),
    ),
    "llama-3.1-8b": llama_config(
        **_META_LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=128,
        intermediate_size=14336, tie_word_embeddings=False, rope_parameters=_llama3_rope(500000.0, 8.0),
    ),
    "llama-3.1-70b": llama_config(
        **_META_LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, head_dim=128,
        intermediate_size=28672, tie_word_embeddings=False, rope_parameters=_llama3_rope(500000.0, 8.0),
    ),
    "qwen2.5-0.5b": _qwen25(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, max_position_embeddings=32768, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _qwen25(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, max_position_embeddings=131072, vocab_size=152064, tie_word_embeddings=False,
    ),
    "qwen3-0.6b": _qwen3(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072,
                         tie_word_embeddings=True),
    "qwen3-8b": _qwen3(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, intermediate_size=12288,
                       tie_word_embeddings=False),
    "mistral-7b": family_config(  # v0.3: the 32768-token vocabulary, no sliding window
        "mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32768, max_position_embeddings=32768,
        rms_norm_eps=1e-5, initializer_range=0.02, sliding_window=None, dtype=BF16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "phi-3-mini": family_config(  # Phi-3-mini-4k-instruct
        "phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, vocab_size=32064, max_position_embeddings=4096,
        original_max_position_embeddings=4096, sliding_window=2047, initializer_range=0.02, bos_token_id=1,
        eos_token_id=32000, pad_token_id=32000, dtype=BF16,
    ),
    "phi-4-mini": family_config(  # Phi-4-mini-instruct: 3/4 of each head rotates, longrope past 4096 tokens
        "phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=200064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, sliding_window=262144, tie_word_embeddings=True,
        initializer_range=0.02, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999, dtype=BF16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 4096, "long_factor": _PHI4_LONG_FACTOR,
                         "short_factor": [1.0] * 48},
    ),
    "gemma-2-2b": _gemma2(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                          intermediate_size=9216),
    "gemma-2-9b": _gemma2(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                          intermediate_size=14336),
    "gemma-3-270m": _gemma3(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=2048, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
        full_rope={"rope_type": "default"},
    ),
    "gemma-3-1b": _gemma3(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
        full_rope={"rope_type": "default"},
    ),
    "gemma-3-4b": _gemma3(  # the language model of Gemma-3-4B (a gemma3 multimodal checkpoint)
        hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=10240, vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
        full_rope={"rope_type": "linear", "factor": 8.0},
    ),
    "qwen3-30b-a3b": family_config(  # 128 experts of 768, 8 routed a token: 30.5B parameters, 3.3B active
        "qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=40960, max_window_layers=48, layer_types=[FULL] * 48,
        bos_token_id=151643, eos_token_id=151645, initializer_range=0.02, dtype=BF16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "mixtral-8x7b": family_config(  # Mixtral-8x7B-v0.1: 8 experts of 14336, 2 routed a token: 46.7B, 12.9B active
        "mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, router_aux_loss_coef=0.02, initializer_range=0.02,
        dtype=BF16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "glm-4.5-air": family_config(  # 128 routed experts of 1408 + 1 shared, 8 routed a token, layer 0 dense:
        # 106B parameters, 12B active; the release's multi-token-prediction layer (46) is not written (never read)
        "glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, use_qk_norm=False, attention_bias=True, vocab_size=151552,
        max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=1, bos_token_id=None,
        eos_token_id=[151329, 151336, 151338], pad_token_id=151329, initializer_range=0.02, dtype=BF16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    ),
    "deepseek-v3": family_config(  # DeepSeek-V3 (and V3-0324, R1: the same shape), from memory of its config.json:
        # 256 routed experts of 2048 + 1 shared, 8 routed a token within the best 4 of 8 groups, layers 0-2 dense,
        # MLA (q latent 1536, kv latent 512, key heads 128 + 64, value heads 128), yarn x40 over 4096 positions;
        # 671B parameters, the release's multi-token-prediction layer (61) not written (never read)
        "deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, head_dim=64,
        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, num_nextn_predict_layers=1,
        initializer_range=0.02, dtype=BF16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "llama-4-scout": family_config(  # Llama-4-Scout-17B-16E's language model, from memory of its config.json (not
        # checked against the hub): 16 experts of 8192 + a shared one, 1 routed a token, every layer sparse; chunks of
        # 8192 on the rotary layers, every 4th layer NoPE; llama3 rope x16 over 8192 positions
        "llama4_text", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=1, moe_layers=list(range(48)), no_rope_layer_interval=4,
        no_rope_layers=[1, 1, 1, 0] * 12, layer_types=[CHUNKED, CHUNKED, CHUNKED, FULL] * 12,
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, vocab_size=202048,
        max_position_embeddings=10485760, bos_token_id=200000, eos_token_id=[200001, 200007, 200008],
        pad_token_id=200018, initializer_range=0.02, dtype=BF16,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    ),
    "gpt-oss-20b": family_config(  # 32 experts of 2880, 4 routed a token: 20.9B parameters (stored here in bf16;
        # the release stores its experts in MXFP4, which ovshard refuses until dequantized)
        "gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        max_position_embeddings=131072, sliding_window=128, layer_types=[SLIDING, FULL] * 12,
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999, initializer_range=0.02, dtype=BF16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    ),
}  # fmt: skip


def preset(name: str, **overrides: Any) -> dict[str, Any]:
    """A fresh copy of ``SHAPES[name]`` with ``overrides`` applied."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape preset {name!r}; choose one of {', '.join(SHAPES)}")
    config = copy.deepcopy(SHAPES[name])
    config.update(copy.deepcopy(overrides))
    return config
