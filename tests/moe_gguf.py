"""Hugging Face mixture-of-experts checkpoints written as GGUF files the way llama.cpp's convert_hf_to_gguf.py
writes them.

Mixtral: convert_hf_to_gguf.py converts MixtralForCausalLM with its ``LlamaModel`` class: GGUF architecture "llama"
with ``llama.expert_count``; q/k rows permuted into llama.cpp's rotary layout; each layer's experts stacked
into one [E, out, in] tensor a projection (w1 -> ffn_gate_exps, w3 -> ffn_up_exps, w2 -> ffn_down_exps);
the router (``block_sparse_moe.gate``) -> ffn_gate_inp, kept f32 whatever the output type. transformers
cannot read such a file, so tests compare it with the checkpoint it came from.

gpt-oss: its ``GptOssModel`` class (from unquantized weights): architecture "gpt-oss"; the experts' x @ W
tensors transposed to [E, out, in], ``gate_up_proj`` split into ffn_gate_exps (even columns) and ffn_up_exps
(odd), its bias likewise; ``sinks`` stored as attn_sinks.weight; yarn rope and the sliding window as metadata.

GLM-4.5: its ``Glm4MoeModel`` class: architecture "glm4moe", no permutation (GLM rotates halves, as llama.cpp's NEOX
rope); the rotary width head_dim * partial_rotary_factor as rope.dimension_count; experts stacked; the routing bias
``e_score_correction_bias`` as exp_probs_b.bias; the routing choices as metadata (expert_shared_count,
leading_dense_block_count, expert groups, sigmoid gating, expert_weights_scale/norm); block_count counting the
next-token-prediction layer the release appends (nextn_predict_layers), whose tensors it writes as blk.N.*.

DeepSeek-V3: its ``DeepseekV2Model`` class: architecture "deepseek2"; MLA written as one key/value head of the latent
(head_count_kv 1, key_length kv_lora_rank + rope, value_length kv_lora_rank) with the per-head widths as
key_length_mla/value_length_mla, and ``kv_b_proj`` split per head into attn_k_b (transposed) and attn_v_b; llama.cpp
before that wrote attn_kv_b whole and the per-head widths as key/value_length (``split_kv_b=False``); yarn's
mscale_all_dim as 0.1 * it in rope.scaling.yarn_log_multiplier; the routing as GLM-4.5's; no MTP layers.

Llama 4: its ``Llama4Model`` class: architecture "llama4", q/k not permuted (llama.cpp rotates Llama 4's interleaved
pairs); feed_forward_length the dense layers' width (intermediate_size_mlp), expert_feed_forward_length the experts';
``gate_up_proj`` [E, hidden, 2 * size] transposed and split in halves into ffn_gate_exps and ffn_up_exps,
``down_proj`` transposed into ffn_down_exps; interleave_moe_layer_step as metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from families import FAMILIES
from transformers import PretrainedConfig

EXPERT_TENSOR = "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"


def mixtral_config() -> PretrainedConfig:
    """families' tiny Mixtral as llama.cpp runs it: no sliding window (a GGUF stores none, llama.cpp runs Mixtral
    as llama), and experts 64 wide (a Q8_0 block is 32 values of a row, so every row length divides by 32)."""
    config = FAMILIES["mixtral"].config()
    config.sliding_window, config.intermediate_size = None, 64
    return config


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _writer(path: Path, arch: str, name: str, config: dict[str, Any], experts: str = "num_local_experts",
            extra_blocks: int = 0) -> Any:
    """A GGUFWriter with the metadata every MoE file here states: sizes, heads, rope base, norm epsilon, experts
    (their count under the config key ``experts``); ``extra_blocks`` layers after the model's (next-token
    prediction)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"] + extra_blocks)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config[experts])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    return writer


def _finish(writer: Any, tensors: dict[str, np.ndarray], qtype: str, quantized: Callable[[str, np.ndarray], bool]) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    for name, data in tensors.items():
        if kind != gguf.GGMLQuantizationType.F32 and quantized(name, data):
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stacked_experts(state: dict[str, np.ndarray], names: Any, sparse: range, experts: int) -> dict[str, np.ndarray]:
    """The converter's stacked experts of ``mlp.experts.{e}``-named checkpoints (GLM, DeepSeek): per sparse layer and
    projection one [experts, out, in] tensor under its llama.cpp name."""
    return {names.get_name(f"model.layers.{i}.mlp.experts.{w}.weight", try_suffixes=(".weight",)):
            np.stack([state[f"model.layers.{i}.mlp.experts.{e}.{w}.weight"] for e in range(experts)])
            for i in sparse for w in ("down_proj", "gate_proj", "up_proj")}


def write_mixtral_gguf(checkpoint: Path, path: Path, qtype: str = "F32") -> Path:
    """The GGUF of the Mixtral ``checkpoint`` (one safetensors file) with matrices stored as ``qtype``."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = _writer(path, "llama", "tiny mixtral", config)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if ".block_sparse_moe.experts." in name:
            continue
        if name.endswith("self_attn.q_proj.weight"):
            w = permute(w, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = permute(w, kv_heads)
        tensors[names.get_name(name, try_suffixes=(".weight",))] = w
    for i in range(layers):  # [E, out, in], under the name LlamaModel gives the stack before mapping it
        for w in ("w1", "w2", "w3"):
            stacked = np.stack([state[EXPERT_TENSOR.format(i=i, e=e, w=w)] for e in range(config["num_local_experts"])])
            tensors[names.get_name(f"layers.{i}.feed_forward.experts.{w}.weight", try_suffixes=(".weight",))] = stacked
    _finish(writer, tensors, qtype, lambda name, data: data.ndim >= 2 and ".ffn_gate_inp." not in name)
    return path


def gpt_oss_config() -> PretrainedConfig:
    """families' tiny gpt-oss as llama.cpp runs it: the SwiGLU limit gpt-oss ships (7.0; llama.cpp fixes it, the file
    stores none) and yarn with its correction range rounded to whole dimensions (ggml's, transformers' truncate)."""
    config = FAMILIES["gpt_oss"].config()
    config.swiglu_limit = 7.0
    config.rope_parameters = {k: v for k, v in config.rope_parameters.items() if k != "truncate"}
    return config


def write_gpt_oss_gguf(checkpoint: Path, path: Path, expert_qtype: str = "F32",
                       vocabulary: tuple[list[str], list[str]] | None = None, fuse_gate_up: bool = False) -> Path:
    """The GGUF of the gpt-oss ``checkpoint``, its stacked experts stored as ``expert_qtype`` (MXFP4, as llama.cpp
    repacks gpt-oss's own release), everything else f32; ``vocabulary``: (tokens, merges) of a BPE tokenizer;
    ``fuse_gate_up``: the expert weights' gate and up halves in one ffn_gate_up_exps (--fuse-gate-up-exps)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    layers, rope = config["num_hidden_layers"], config["rope_parameters"]
    writer = _writer(path, "gpt-oss", "tiny gpt-oss", config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    if vocabulary is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-4o")
        writer.add_token_list(vocabulary[0])
        writer.add_token_merges(vocabulary[1])
        writer.add_token_types([1] * len(vocabulary[0]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if name.endswith("self_attn.sinks"):
            name += ".weight"
        if name.endswith("experts.down_proj_bias"):
            name = name.replace("down_proj_bias", "down_proj.bias")
        elif name.endswith("experts.down_proj"):
            name, w = name.replace("down_proj", "down_proj.weight"), w.swapaxes(-1, -2)  # [E, hidden, size]
        elif name.endswith("experts.gate_up_proj_bias"):  # gate the even columns, up the odd
            for part, half in (("gate_proj.bias", w[..., ::2]), ("up_proj.bias", w[..., 1::2])):
                tensors[names.get_name(name.replace("gate_up_proj_bias", part), try_suffixes=(".bias",))] = half
            continue
        elif name.endswith("experts.gate_up_proj"):
            w = w.swapaxes(-1, -2)  # [E, 2 * size, hidden]
            if fuse_gate_up:
                fused = names.get_name(name.replace("gate_up_proj", "gate_proj.weight"), try_suffixes=(".weight",))
                tensors[fused.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([w[:, ::2], w[:, 1::2]], 1)
                continue
            for part, half in (("gate_proj.weight", w[:, ::2]), ("up_proj.weight", w[:, 1::2])):
                tensors[names.get_name(name.replace("gate_up_proj", part), try_suffixes=(".weight",))] = half
            continue
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    _finish(writer, tensors, expert_qtype, lambda name, data: data.ndim == 3)
    return path


def glm4_moe_config() -> PretrainedConfig:
    """families' tiny GLM-4.5 with experts 32 wide (a Q8_0 block is 32 values of a row, so every row length divides
    by 32; its shared experts 64)."""
    config = FAMILIES["glm4_moe"].config()
    config.moe_intermediate_size = 32
    return config


def write_glm4_moe_gguf(checkpoint: Path, path: Path, qtype: str = "F32", gating: int = 2) -> Path:
    """The GGUF of the GLM-4.5 ``checkpoint``, matrices stored as ``qtype`` (the router and vectors f32), with one
    next-token-prediction layer after the model's, as the release holds: a copy of the last layer's tensors plus
    its nextn.* tensors (eh_proj, enorm, hnorm, shared_head_norm), random, which a reader must skip. ``gating``:
    the expert_gating_func stated (2 sigmoid, GLM's; 1 softmax)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    layers, hidden, experts = config["num_hidden_layers"], config["hidden_size"], config["n_routed_experts"]
    writer = _writer(path, "glm4moe", "tiny glm4.5", config, experts="n_routed_experts", extra_blocks=1)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    partial = config.get("partial_rotary_factor", config["rope_parameters"].get("partial_rotary_factor", 0.5))
    writer.add_rope_dimension_count(int(config["head_dim"] * partial))
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_nextn_predict_layers(1)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + 1)
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if ".mlp.experts." in name:
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    tensors |= _stacked_experts(state, names, range(config["first_k_dense_replace"], layers), experts)
    rng = np.random.default_rng(0)
    last = f"blk.{layers - 1}."
    tensors |= {f"blk.{layers}." + n.removeprefix(last): rng.standard_normal(w.shape).astype(np.float32)
                for n, w in list(tensors.items()) if n.startswith(last)}
    tensors[f"blk.{layers}.nextn.eh_proj.weight"] = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        tensors[f"blk.{layers}.nextn.{norm}.weight"] = np.ones(hidden, np.float32)
    _finish(writer, tensors, qtype, lambda name, data: data.ndim >= 2 and ".ffn_gate_inp." not in name)
    return path


def deepseek_plain_q_config() -> PretrainedConfig:
    """families' DeepSeek without a q latent, rotating interleaved pairs: llama.cpp's deepseek2 rotates pairs whatever
    the source says, so only such a checkpoint is what llama.cpp computes."""
    config = FAMILIES["deepseek_v3_plain_q"].config()
    config.rope_interleave = True
    return config


def write_deepseek_gguf(checkpoint: Path, path: Path, split_kv_b: bool = True, gating: int | None = 2) -> Path:
    """The F32 GGUF of the DeepSeek-V3 ``checkpoint``; ``split_kv_b``: kv_b_proj split into attn_k_b/attn_v_b
    (current llama.cpp), else whole as attn_kv_b (llama.cpp before its absorbed MLA); ``gating``: the
    expert_gating_func stated (2 sigmoid, config.json's scoring_func; None: none, as DeepSeek-V2 files)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    layers, heads, experts = config["num_hidden_layers"], config["num_attention_heads"], config["n_routed_experts"]
    rank, rope, nope, v = (config[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    writer = _writer(path, "deepseek2", "tiny deepseek-v3", config | {"num_key_value_heads": 1 if split_kv_b else heads},
                     experts="n_routed_experts")
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    if gating is not None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    if config["q_lora_rank"] is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    if split_kv_b:
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    params = config["rope_parameters"]
    if params["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, layers)
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("kv_b_proj.weight") and split_kv_b:  # [heads, nope + v, rank]: k_b transposed, v_b
            kv_b = w.reshape(heads, nope + v, rank)
            for part, half in (("k_b_proj", kv_b[:, :nope].swapaxes(1, 2)), ("v_b_proj", kv_b[:, nope:])):
                tensors[names.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",))] = half
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    tensors |= _stacked_experts(state, names, range(config["first_k_dense_replace"], layers), experts)
    _finish(writer, tensors, "F32", lambda name, data: False)
    return path


def llama4_config() -> PretrainedConfig:
    """families' tiny Llama 4 with what llama.cpp fixes for the architecture (the file states none of it): chunks of
    8192, every 4th layer NoPE, attention temperature floor 8192 and scale 0.1, q/k norms (fewer than 128 experts)."""
    config = FAMILIES["llama4_text"].config()
    config.attention_chunk_size, config.no_rope_layer_interval, config.floor_scale, config.attn_scale = 8192, 4, 8192, 0.1
    config.no_rope_layers = [int((i + 1) % 4 != 0) for i in range(config.num_hidden_layers)]
    config.layer_types = ["chunked_attention" if rope else "full_attention" for rope in config.no_rope_layers]
    return config


def write_llama4_gguf(checkpoint: Path, path: Path, chunked: bool = True) -> Path:
    """The F32 GGUF of the Llama 4 (text) ``checkpoint``; ``chunked`` False: stating attention.sliding_window 0, as
    MobileLLM's files (no chunks, rotary on every layer) do."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    size = config["intermediate_size"]
    writer = _writer(path, "llama4", "tiny llama 4", config | {"intermediate_size": config["intermediate_size_mlp"]})
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    if not chunked:
        writer.add_sliding_window(0)
    writer.add_expert_feed_forward_length(size)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, config["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2 * size, hidden]: gate the first half
            w = w.swapaxes(-1, -2)
            for part, half in (("gate_proj.weight", w[:, :size]), ("up_proj.weight", w[:, size:])):
                tensors[names.get_name(name.replace("gate_up_proj", part), try_suffixes=(".weight",))] = half
            continue
        if name.endswith("experts.down_proj"):
            name, w = name + ".weight", w.swapaxes(-1, -2)  # [E, hidden, size]
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    _finish(writer, tensors, "F32", lambda name, data: False)
    return path
