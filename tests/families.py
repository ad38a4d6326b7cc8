"""Tiny random-weight checkpoints of every model family of the architecture table (the family tests and the
logit-row tests compile them)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    Llama4TextConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from ovshard.frontend.arch import ARCHITECTURES

SEED_STD = 0.2  # weights ~ N(0, 0.2^2); norm scales and biases get the same noise added
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Family:
    """One family variant: its tiny transformers config and how it is compiled."""

    config: Callable[[], PretrainedConfig]
    max_positions: int | None = None  # CompileConfig.max_positions; None: the config's max_position_embeddings
    # Gemma multiplies the embedding by sqrt(hidden) = 8: an 8x smaller one starts the residual stream at the
    # other families' scale (a full-size tied one makes the model repeat its last input token)
    embed_std: float = SEED_STD
    seed: int = 0
    explicit_attention: bool = False  # attention soft-capping (Gemma 2) has no SDPA form: no layer fuses


def _qwen2() -> PretrainedConfig:
    # q/k/v biases; head_dim 12 = 48 / 4; layers from max_window_layers=1 on slide over 8 tokens; tied
    return Qwen2Config(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1, tie_word_embeddings=True, max_position_embeddings=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _qwen3() -> PretrainedConfig:
    # per-head q/k RMSNorm; head_dim 24 != 64 / 4; GQA 4:2; untied
    return Qwen3Config(vocab_size=384, eos_token_id=383, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                       max_position_embeddings=128, rope_parameters=ROPE)


def _mistral() -> PretrainedConfig:
    # every layer slides over 16 tokens; head_dim 16 != 64 / 8; GQA 8:2; untied
    return MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=16,
                         tie_word_embeddings=False, max_position_embeddings=128, rope_parameters=ROPE)


def phi3() -> PretrainedConfig:
    # Phi-3-mini's block: fused qkv_proj and gate_up_proj, MHA, untied, every layer slides (over 8 tokens here)
    return Phi3Config(vocab_size=300, eos_token_id=299, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, sliding_window=8, tie_word_embeddings=False,
                      max_position_embeddings=128, original_max_position_embeddings=128,
                      rope_parameters={**ROPE, "partial_rotary_factor": 1.0}, pad_token_id=0)


def _phi4_mini_like() -> PretrainedConfig:
    # Phi-4-mini's block: fused qkv_proj and gate_up_proj; 3/4 of each 16-wide head rotates (6 frequencies) with
    # longrope; GQA; tied; a sliding window of 8 as well. The bundle holds 64
    # positions = original_max_position_embeddings, below which longrope uses its short factors
    factors = {"short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.8], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}
    return Phi3Config(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=True,
                      max_position_embeddings=256, original_max_position_embeddings=64, pad_token_id=0,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                       "original_max_position_embeddings": 64, **factors})


def _gemma2() -> PretrainedConfig:
    # sandwich norms x * (1 + w), sqrt(hidden) embedding scale, GELU-tanh; query_pre_attn_scalar 24 != head_dim 32;
    # softcaps small enough to bend the logits; sliding (8 tokens) and full layers alternate; tied
    return Gemma2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=8,
                        layer_types=[SLIDING, FULL, SLIDING], tie_word_embeddings=True,
                        max_position_embeddings=128, rope_parameters=ROPE)


def _gemma3_text_config(**overrides: object) -> dict[str, object]:
    # q/k norms; local rope (10000) on sliding layers, global (1e6, linear x2) on full ones; MQA; head_dim 32
    config: dict[str, object] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=20, sliding_window=8,
        layer_types=[SLIDING, SLIDING, FULL], max_position_embeddings=128,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
    )
    config.update(overrides)
    return config


def _gemma3_text() -> PretrainedConfig:
    return Gemma3TextConfig(**_gemma3_text_config(), tie_word_embeddings=False)


def _gemma3_multimodal() -> PretrainedConfig:
    # Gemma3ForConditionalGeneration with a one-layer SigLIP tower: ovshard compiles its language model
    text = _gemma3_text_config(layer_types=[SLIDING, FULL, SLIDING])
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=300,
                        eoi_token_index=301, image_token_index=302, tie_word_embeddings=True)


def _qwen3_moe() -> PretrainedConfig:
    # 8 experts of 32, top-2 renormalized (norm_topk_prob, as Qwen3-30B-A3B); q/k norms; head_dim 16; untied
    return Qwen3MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          tie_word_embeddings=False, max_position_embeddings=128, rope_parameters=ROPE)


def _qwen3_moe_top4() -> PretrainedConfig:
    # 6 experts of 24, top-4 NOT renormalized (norm_topk_prob false: the weights sum to less than 1); tied
    return Qwen3MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, num_experts=6, num_experts_per_tok=4, norm_topk_prob=False,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=12,
                          tie_word_embeddings=True, max_position_embeddings=128, rope_parameters=ROPE)


def _qwen2_moe() -> PretrainedConfig:
    # q/k/v biases; 6 experts of 24, top-2 not renormalized, plus a shared expert of 40 behind its sigmoid gate
    return Qwen2MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                          num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128,
                          rope_parameters=ROPE)


def _qwen3_moe_dense_between() -> PretrainedConfig:
    # layer 1 of 3 dense (mlp_only_layers) between two sparse ones: 6 experts of 24, top-4 renormalized
    return Qwen3MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, num_experts=6, num_experts_per_tok=4, norm_topk_prob=True,
                          mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=12, tie_word_embeddings=False, max_position_embeddings=128, rope_parameters=ROPE)


def _qwen2_moe_sparse_step() -> PretrainedConfig:
    # decoder_sparse_step 2: layers 0 and 2 of 3 dense (the first and the last), layer 1 sparse with its shared
    # expert; 6 experts of 24, top-2
    return Qwen2MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                          num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          max_position_embeddings=128, rope_parameters=ROPE)


def _glm4_moe() -> PretrainedConfig:
    # GLM-4.5's block: q/k/v biased, per-head q/k norms (use_qk_norm), half of each 16-wide head rotated; layer 0
    # dense (first_k_dense_replace 1); 8 experts of 24 in 4 groups, top-2 within the best 2 groups by sigmoid score
    # + correction bias, renormalized and x2.5, plus a shared expert (n_shared_experts 2: 48 wide); untied
    return Glm4MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                         n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                         use_qk_norm=True, attention_bias=True, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=128,
                         rope_parameters={**ROPE, "partial_rotary_factor": 0.5})


def _glm4_moe_air() -> PretrainedConfig:
    # GLM-4.5-Air's choices: no q/k norms, one group, top-4 of 8 not renormalized, scale 1, one shared expert;
    # layers 0 and 1 dense of 4; partial rotary 0.5 given at the top level as GLM's config.json does; tied
    return Glm4MoeConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                         moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=1, topk_group=1,
                         n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense_replace=2,
                         use_qk_norm=False, attention_bias=True, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=12, tie_word_embeddings=True, max_position_embeddings=128,
                         partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _deepseek_v3() -> PretrainedConfig:
    # DeepSeek-V3's block: q through a 24-wide latent (q_lora_rank), keys and values from a 16-wide latent plus an
    # 8-wide rotary key shared by the heads, interleaved rotary pairs; a key head 16 + 8 wide, a value head 12
    # (unequal, as 192 vs 128); yarn x4 over 32 positions with mscale_all_dim (the softmax scale times mscale^2);
    # layer 0 dense; 8 experts in 4 groups, top-2 within the best 2 by sigmoid + correction bias, renormalized,
    # x2.5, one shared expert; q_a, kv_a and o biased (attention_bias); untied
    return DeepseekV3Config(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                            rope_interleave=True, attention_bias=True, tie_word_embeddings=False,
                            max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def _deepseek_v3_plain_q() -> PretrainedConfig:
    # no q latent (q_lora_rank None: one q_proj, as DeepSeek-V2-Lite); rotary halves (rope_interleave false), the
    # default rope; layers 0 and 1 dense of 4; 6 experts in one group, top-4 not renormalized, x1; two shared
    # experts (48 wide); tied
    return DeepseekV3Config(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=96,
                            moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=4, n_group=1,
                            topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
                            first_k_dense_replace=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                            q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                            rope_interleave=False, tie_word_embeddings=True, max_position_embeddings=128,
                            rope_parameters=ROPE)


def _gpt_oss() -> PretrainedConfig:
    # attention sinks; q/k/v/o biased; sliding (8) and full layers; yarn rope; 4 experts, top-2 by logit then a
    # softmax over those two; biased router; clamped SwiGLU with a limit (0.6) low enough to clamp here
    return GptOssConfig(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING], swiglu_limit=0.6,
                        tie_word_embeddings=False, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 128})


def _llama4_text() -> PretrainedConfig:
    # Llama 4's block: rotary layers (interleaved pairs, then q/k L2 norms) attend within chunks of 8 positions, NoPE
    # layers 1 and 3 (every 2nd) globally with temperature tuning that grows every 4 positions; layers 1 and 3
    # sparse (interleave_moe_layer_step 2): 4 experts of 32 stacked, top-1 by sigmoid scaling the expert's input,
    # plus a shared expert of 32; layers 0 and 2 dense of 96 (intermediate_size_mlp); GQA 4:2; untied
    return Llama4TextConfig(vocab_size=320, eos_token_id=319, hidden_size=64, intermediate_size=32,
                            intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                            interleave_moe_layer_step=2, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, no_rope_layer_interval=2, attention_chunk_size=8,
                            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
                            tie_word_embeddings=False, max_position_embeddings=128, rope_parameters=ROPE)


def _llama4_text_top2() -> PretrainedConfig:
    # every layer sparse: 6 experts of 24, top-2, a shared expert; NoPE layer 2 of 3 (every 3rd); no q/k norms;
    # chunks of 8; Scout's llama3 rope scaling; tied
    return Llama4TextConfig(vocab_size=320, eos_token_id=319, hidden_size=48, intermediate_size=24,
                            intermediate_size_mlp=64, num_local_experts=6, num_experts_per_tok=2,
                            interleave_moe_layer_step=1, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=12, no_rope_layer_interval=3, attention_chunk_size=8,
                            floor_scale=8, attn_scale=0.3, use_qk_norm=False, tie_word_embeddings=True,
                            max_position_embeddings=128,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 32})


def _mixtral() -> PretrainedConfig:
    # Mixtral's block: 4 experts of 48 (w1/w3/w2), top-2 always renormalized; GQA 4:1; every layer slides over 8
    return MixtralConfig(vocab_size=300, eos_token_id=299, hidden_size=64, intermediate_size=48, num_local_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                         sliding_window=8, tie_word_embeddings=False, max_position_embeddings=128,
                         rope_parameters=ROPE)


FAMILIES: dict[str, Family] = {
    "qwen2": Family(_qwen2),
    "qwen3": Family(_qwen3),
    "mistral": Family(_mistral),
    "phi3": Family(phi3),
    "phi3_partial_longrope": Family(_phi4_mini_like, max_positions=64, seed=2),
    "gemma2": Family(_gemma2, embed_std=SEED_STD / 8, explicit_attention=True),
    "gemma3_text": Family(_gemma3_text, embed_std=SEED_STD / 8),
    "gemma3": Family(_gemma3_multimodal, embed_std=SEED_STD / 8, seed=2),  # seed 0 emits the image token
    "qwen3_moe": Family(_qwen3_moe),
    "qwen3_moe_top4": Family(_qwen3_moe_top4),
    "qwen2_moe": Family(_qwen2_moe, seed=1),
    "qwen3_moe_dense_between": Family(_qwen3_moe_dense_between),
    "qwen2_moe_sparse_step": Family(_qwen2_moe_sparse_step),
    "glm4_moe": Family(_glm4_moe, seed=1),
    "glm4_moe_air": Family(_glm4_moe_air),
    "deepseek_v3": Family(_deepseek_v3),
    "deepseek_v3_plain_q": Family(_deepseek_v3_plain_q),
    "llama4_text": Family(_llama4_text),
    "llama4_text_top2": Family(_llama4_text_top2),
    "mixtral": Family(_mixtral),
    "gpt_oss": Family(_gpt_oss, max_positions=256, explicit_attention=True, seed=3),
}


_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")


def as_saved_state(state: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A transformers 5 state dict as its checkpoint stores it: a MoE model holds each layer's experts fused
    (gate_up [E, 2I, H], down [E, H, I]) and saves one matrix per expert, under the family's names."""
    spec = ARCHITECTURES[model_type]
    if not spec.moe or spec.stacked_experts:  # gpt-oss saves its 3-D expert tensors as it holds them
        return state
    assert spec.router and spec.expert_gate and spec.expert_up and spec.expert_down
    saved = {}
    for name, tensor in state.items():
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            saved[name] = tensor
        elif match[2] == "gate.weight":
            saved[spec.router.format(i=match[1]) + ".weight"] = tensor
        else:
            for e in range(tensor.shape[0]):
                gate, up, down = (t.replace("{i}", match[1]).replace("{e}", str(e)) + ".weight"
                                  for t in (spec.expert_gate, spec.expert_up, spec.expert_down))
                if match[2] == "experts.down_proj":
                    saved[down] = tensor[e]
                else:
                    saved[gate], saved[up] = tensor[e].chunk(2, dim=0)
    return saved


def write_random_checkpoint(family: Family, root: Path) -> Path:
    """``save_pretrained`` of a seeded random model: matrices N(0, 0.2^2), 1-D tensors (norms, biases) + noise."""
    torch.manual_seed(family.seed)
    model = AutoModelForCausalLM.from_config(family.config())
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, SEED_STD)
            else:  # ones for w * x norms, zeros for Gemma's x * (1 + w) norms and for biases: all get noise
                param.add_(torch.randn_like(param) * SEED_STD)
        model.get_input_embeddings().weight.normal_(0.0, family.embed_std)
        for name, buffer in model.named_buffers():  # GLM's routing correction bias: zeros would test nothing
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * SEED_STD)
    model.save_pretrained(root)
    return root


def _qwen3_moe_text() -> PretrainedConfig:
    # _qwen3_moe's shape over stories260K's 512-token vocabulary and special tokens, so that its tokenizer fits
    return Qwen3MoeConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          tie_word_embeddings=False, max_position_embeddings=512, rope_parameters=ROPE)


def _glm4_moe_text() -> PretrainedConfig:
    # _glm4_moe's block over stories260K's vocabulary and special tokens: layer 0 dense, 3 sparse (grouped top-2)
    return Glm4MoeConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                         n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                         use_qk_norm=True, attention_bias=True, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=512,
                         rope_parameters={**ROPE, "partial_rotary_factor": 0.5})


def _deepseek_v3_text() -> PretrainedConfig:
    # _deepseek_v3's block (without yarn) over stories260K's vocabulary and special tokens: layer 0 dense, 3 sparse
    return DeepseekV3Config(vocab_size=512, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            first_k_dense_replace=1, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                            tie_word_embeddings=False, max_position_embeddings=512, rope_parameters=ROPE)


def _llama4_text_text() -> PretrainedConfig:
    # _llama4_text's block over stories260K's vocabulary and special tokens: layers 1 and 3 NoPE and sparse
    return Llama4TextConfig(**{**_llama4_text().to_dict(), "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
                               "max_position_embeddings": 512})


MOE_TEXT = {"qwen3_moe": _qwen3_moe_text, "glm4_moe": _glm4_moe_text, "deepseek_v3": _deepseek_v3_text,
            "llama4_text": _llama4_text_text}


def moe_with_tokenizer(stories: Path, root: Path, model_type: str = "qwen3_moe") -> Path:
    """A random MoE checkpoint (Qwen3-MoE, or GLM-4.5's block: ``MOE_TEXT``) that carries stories260K's tokenizer
    (its files linked): an MoE bundle that serves text, for the API and `ovshard up` tests."""
    write_random_checkpoint(Family(MOE_TEXT[model_type]), root)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / name).symlink_to(stories / name)
    return root
