"""A Hugging Face Mixtral checkpoint written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one.

convert_hf_to_gguf.py converts MixtralForCausalLM with its ``LlamaModel`` class: GGUF architecture "llama"
with ``llama.expert_count``; q/k rows permuted into llama.cpp's rotary layout; each layer's experts stacked
into one [E, out, in] tensor a projection (w1 -> ffn_gate_exps, w3 -> ffn_up_exps, w2 -> ffn_down_exps);
the router (``block_sparse_moe.gate``) -> ffn_gate_inp, kept f32 whatever the output type. transformers
cannot read such a file, so tests compare it with the checkpoint it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def write_mixtral_gguf(checkpoint: Path, path: Path, qtype: str = "F32") -> Path:
    """The GGUF of the Mixtral ``checkpoint`` (one safetensors file) with matrices stored as ``qtype``."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    state = load_file(checkpoint / "model.safetensors")
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny mixtral")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_eos_token_id(config["eos_token_id"])
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
    kind = gguf.GGMLQuantizationType[qtype]
    for name, data in tensors.items():
        if data.ndim >= 2 and kind != gguf.GGMLQuantizationType.F32 and ".ffn_gate_inp." not in name:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
